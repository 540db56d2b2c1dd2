"""`python -m runtime_hook prestart|poststop`: the hook (runtime_hook.main)."""

import sys

from runtime_hook.main import main

if __name__ == "__main__":
    sys.exit(main())
