"""`python -m vgpuctl`."""

import sys

from vgpuctl.cli import main

if __name__ == "__main__":
    sys.exit(main())
