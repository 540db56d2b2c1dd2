"""Logging of every part: one key=value line format (`kv`), and the daemons' logger setup.

`kv` is the one formatter of structured lines: the hook (runtime_hook.hooklog) writes them to its
own file, the daemons through `logging`. Cheap to import (the hook imports it for every vGPU
container): `logging` is imported only by `setup_logging`.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs the hook ~3 ms
if TYPE_CHECKING:
    from typing import Any

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_QUOTE = frozenset(' "=\n\r\t')


def kv(msg: str, **fields: object) -> str:
    """`msg key=value ...`: a value that is empty or holds a space, quote, '=' or line break is
    written as its repr, so one event is always one line and every value reads back."""
    parts = [msg]
    for k, v in fields.items():
        s = str(v)
        if not s or not _QUOTE.isdisjoint(s):
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
    import logging
    import logging.handlers
    import os
    import sys

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
