from __future__ import annotations

import os
from typing import Any

import pytest

from tests.image import imagebuild


@pytest.fixture(scope="session")
def image() -> dict[str, Any]:
    """`make image`'s output (built once per session; cached by content hash across sessions)."""
    if os.geteuid() != 0:
        pytest.skip("make image needs root (mmdebstrap, chroot)")
    return imagebuild.build()
