"""`vgpu-hook` / `python -m runtime_hook`: see runtime_hook.fastpath (the hot path) and runtime_hook.cli."""

from __future__ import annotations

import sys

from runtime_hook.fastpath import main

if __name__ == "__main__":
    sys.exit(main())
