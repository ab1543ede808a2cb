"""One log line format for Shoal's and uvicorn's loggers; probes' access lines at DEBUG."""

from __future__ import annotations

import logging

from shoal.runtime.entrypoints.errors import PROBE_PATHS


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _ProbeFilter(logging.Filter):
    """Access-log lines of /health, /ready and /metrics are DEBUG: probes every few seconds
    would drown everything else at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and str(args[2]).split("?")[0] in PROBE_PATHS:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger("uvicorn.access").isEnabledFor(logging.DEBUG) and logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def configure_logging(level: str) -> None:
    """One line format for Shoal's and uvicorn's loggers (uvicorn's own config is not used)."""
    level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for name in ("shoal", "uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.setLevel(level)
        lg.handlers.clear()
        lg.propagate = True
    logging.getLogger("uvicorn.access").addFilter(_ProbeFilter())
