"""Run Shoal from a checkout without installing it: maps the folders onto the shoal.*
namespace the way setup.py's package_dir does, then runs a module or a script.

    python3 tools/nopip.py -m shoal.runtime.bench.gpu_check [ARGS...]
    python3 tools/nopip.py path/to/script.py [ARGS...]

A meta-path finder resolves `shoal`, `shoal.runtime`, `shoal.kernels` and `shoal.operator`
to shoal/, runtime/, kernels/ and operator/ (their submodules follow from the packages'
__path__). The checkout root is never put on sys.path, so its top-level kernels/ and
operator/ never shadow Hugging Face's `kernels` or the standard library's `operator`.
Nothing here needs more than the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = {"shoal": "shoal", "shoal.runtime": "runtime", "shoal.kernels": "kernels", "shoal.operator": "operator"}
ENV = "SHOAL_NOPIP"  # set for child processes: run them through this launcher too


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the four shoal packages in the checkout, before any installed copy."""

    def find_spec(self, fullname, path=None, target=None):
        folder = ROOTS.get(fullname)
        if folder is None:
            return None
        pkg = os.path.join(REPO, folder)
        return importlib.util.spec_from_file_location(fullname, os.path.join(pkg, "__init__.py"),
                                                      submodule_search_locations=[pkg])


def spawn_shim() -> str:
    """A folder holding a `shoal` package whose __path__ reaches the checkout's folders, for
    the processes multiprocessing spawns (the engine-core process): they inherit sys.path,
    not this finder. Written once per checkout, rewritten only when it changes."""
    import hashlib
    import tempfile

    tag = hashlib.sha1(REPO.encode()).hexdigest()[:12]
    pkg = os.path.join(tempfile.gettempdir(), f"shoal-nopip-{os.getuid()}-{tag}", "shoal")
    real = os.path.join(REPO, "shoal", "__init__.py")
    # shoal.runtime, shoal.kernels and shoal.operator resolve under the root; shoal's own
    # __init__ runs as the real package's
    text = (f"__path__ = [{os.path.join(REPO, 'shoal')!r}, {REPO!r}]\n"
            f"exec(compile(open({real!r}).read(), {real!r}, 'exec'))\n")
    init = os.path.join(pkg, "__init__.py")
    try:
        with open(init) as f:
            current = f.read()
    except OSError:
        current = None
    if current != text:
        os.makedirs(pkg, exist_ok=True)
        tmp = f"{init}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, init)
    return os.path.dirname(pkg)


def install() -> None:
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder())
    os.environ[ENV] = os.path.abspath(__file__)
    shim = spawn_shim()
    if shim not in sys.path:
        sys.path.append(shim)  # last: this finder (and any install) come first
    # `python3 tools/nopip.py` put tools/ first on sys.path; the checkout root is never added
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in (here, REPO)]


def main(argv: list[str]) -> None:
    install()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("nopip.py -m: a module name is needed")
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
