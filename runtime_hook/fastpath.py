"""The script the installed hooks run: `python3 -I -S .../runtime_hook/fastpath.py <flags> prestart|poststop`.

Deliberately tiny (a script is compiled at every start; modules come from
their .pyc): the hot path itself is runtime_hook.hotpath, re-exported here.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and __package__ in (None, ""):
    # Run as a script under -I: the package root is not on sys.path.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime_hook.hotpath import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_LIBRARY_PATH,
    DEFAULT_LOG_DIR,
    DEFAULT_STATE_DIR,
    exit_now,
    fast_state_dir,
    main,
    scan_argv,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_LIBRARY_PATH",
    "DEFAULT_LOG_DIR",
    "DEFAULT_STATE_DIR",
    "exit_now",
    "fast_state_dir",
    "main",
    "scan_argv",
]

if __name__ == "__main__":
    _rc = main()
    if scan_argv(sys.argv[1:])[0] in ("prestart", "poststop"):
        exit_now(_rc)  # no interpreter teardown (hotpath.exit_now says why)
    sys.exit(_rc)
