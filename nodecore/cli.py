"""Command-line pieces both front ends' commands share (vgpu-device-plugin, vgpu-dra-plugin)."""

from __future__ import annotations

import argparse
import math
import os
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """Errors are one line naming the option, exit status 2 (the project's convention)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def finite_float(text: str) -> float:
    """A float flag: inf and nan are refused as argparse refuses any other bad value."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


finite_float.__name__ = "float"  # argparse's message: "invalid float value: 'inf'"


def socket_identity(path: str) -> tuple[int, int] | None:
    """(inode, ctime_ns) of a socket file, None when there is none. Inode numbers are reused at
    once on tmpfs/ext4; with ctime they tell "our socket" from "a new file of the same name"."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns
