"""The script installed hooks run: `python3 -I -S <prefix>/runtime_hook/fastpath.py <flags> prestart|poststop`.

A shim (a script is compiled at every start; modules come from their .pyc): the hook is
runtime_hook.main. Its path is written into containerd's and hooks.d's configuration, so it stays.
"""

import os
import sys

if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script under -I: the package root is not on sys.path
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from runtime_hook.main import exit_now, main

    exit_now(main())
