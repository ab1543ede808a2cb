"""tests/router: the router's pure parts, and real `shoal serve` groups behind a real `shoal router`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # server_helpers
