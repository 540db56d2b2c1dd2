"""packaging/requirements.lock (what the deb/rpm venv installs, --no-deps) satisfies every runtime
dependency in pyproject.toml, and is complete: each locked distribution's own requirements are
locked too.  A dependency added to pyproject without `build-venv.sh --relock` fails here, not on
a node."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import msgspec
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "packaging" / "requirements.lock").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            pins[canonicalize_name(name)] = version
    return pins


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


def test_lock_satisfies_pyproject() -> None:
    project = msgspec.toml.decode((ROOT / "pyproject.toml").read_bytes())["project"]
    pins = _lock()
    for spec in project["dependencies"]:
        req = Requirement(spec)
        if not _applies(req):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in packaging/requirements.lock (packaging/build-venv.sh --relock)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} does not satisfy {spec}"


def test_lock_is_closed_under_dependencies() -> None:
    """Every requirement of a locked distribution is locked (checked against the installed
    metadata where the dev venv has the same version)."""
    pins = _lock()
    checked = 0
    for name, version in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != version:
            continue
        checked += 1
        for spec in dist.requires or []:
            req = Requirement(spec)
            if _applies(req):
                assert canonicalize_name(req.name) in pins, f"{name} needs {req.name}, which is not locked"
    assert checked >= len(pins) // 2  # the dev venv mostly has the locked versions
