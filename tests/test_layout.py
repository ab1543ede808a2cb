"""The top-level folders are never importable under their own names (docs/design.md, Layout).

`python -m shoal...` in the checkout puts its root on sys.path, where kernels/ would
shadow Hugging Face's `kernels` package that transformers imports when installed.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = (
    "import importlib.util, shoal\n"
    "spec = importlib.util.find_spec('kernels')\n"
    "print(spec.origin if spec else 'none')\n"
    "import transformers.activations\n"  # imports `kernels` when HF's package is installed
)


def test_checkout_root_does_not_shadow_hf_kernels():
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    origin = r.stdout.strip().splitlines()[-1]
    assert not origin.startswith(str(REPO / "kernels")), f"`kernels` resolves to the checkout: {origin}"


def test_shoal_kernels_is_still_the_project_package():
    r = subprocess.run([sys.executable, "-c", "import shoal.kernels as k; print(k.__file__)"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(REPO / "kernels" / "__init__.py")
