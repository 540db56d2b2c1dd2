"""vgpu.nvml helpers that need no driver: init retry/backoff, NUMA from sysfs."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from vgpu import nvml


def test_normalize_bus_id() -> None:
    assert nvml.normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert nvml.normalize_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert nvml.normalize_bus_id(" 00000001:AF:00.1\n") == "0001:af:00.1"


def _sysfs(root: Path, bus: str, text: str) -> None:
    d = root / "bus" / "pci" / "devices" / bus
    d.mkdir(parents=True)
    (d / "numa_node").write_text(text)


def test_numa_node_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _sysfs(tmp_path, "0000:3b:00.0", "1\n")
    _sysfs(tmp_path, "0000:5e:00.0", "-1\n")
    _sysfs(tmp_path, "0000:af:00.0", "garbage")
    assert nvml.numa_node("00000000:3B:00.0", str(tmp_path)) == 1
    assert nvml.numa_node("00000000:5E:00.0", str(tmp_path)) is None  # -1: unknown
    assert nvml.numa_node("00000000:AF:00.0", str(tmp_path)) is None
    assert nvml.numa_node("00000000:D8:00.0", str(tmp_path)) is None  # missing
    assert nvml.numa_node(None, str(tmp_path)) is None
    assert nvml.numa_node("../../../etc", str(tmp_path)) is None
    monkeypatch.setenv(nvml.SYSFS_ROOT_ENV, str(tmp_path))
    assert nvml.numa_node("0000:3b:00.0") == 1


def test_init_retries_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def flaky() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", flaky)
    sleeps: list[float] = []
    nvml.init(attempts=5, initial_delay=0.5, sleep=sleeps.append)
    assert len(calls) == 3 and sleeps == [0.5, 1.0]


def test_init_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    sleeps: list[float] = []
    with pytest.raises(nvml.NVMLUnavailable, match="cannot initialise NVML"):
        nvml.init(attempts=6, initial_delay=1.0, max_delay=4.0, sleep=sleeps.append)
    assert sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_application_xids() -> None:
    assert {13, 31, 43, 45, 68, 109} == nvml.APPLICATION_XIDS
    assert 79 not in nvml.APPLICATION_XIDS and 48 not in nvml.APPLICATION_XIDS
