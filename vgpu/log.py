"""Logging setup shared by the daemons: structured key=value lines, quiet by default."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from typing import Any

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def kv(msg: str, **fields: Any) -> str:
    """Format a structured log message: `msg key=value ...` (values repr'd when they contain spaces)."""
    parts = [msg]
    for k, v in fields.items():
        s = str(v)
        if not s or any(c in s for c in ' "='):
            s = repr(s)
        parts.append(f"{k}={s}")
    return " ".join(parts)


def setup_logging(
    level: str = "warning",
    *,
    stream: Any = None,
    file: str | None = None,
    max_bytes: int = 4 * 1024 * 1024,
) -> None:
    """Configure the root logger once: to stderr (default) and/or a size-bounded file."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handlers: list[logging.Handler] = []
    if file:
        os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
        handlers.append(logging.handlers.RotatingFileHandler(file, maxBytes=max_bytes, backupCount=1))
    if stream is not None or not file:
        handlers.append(logging.StreamHandler(stream or sys.stderr))
    fmt = logging.Formatter(_FORMAT)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(getattr(logging, level.upper(), logging.WARNING))
