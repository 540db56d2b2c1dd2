"""vgpu-device-plugin's command line: invalid values refuse to start, naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.device_plugin.conftest import run_cli


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--device-split-count", "0"], "--device-split-count"),
        (["--device-split-count", "two"], "--device-split-count"),
        (["--device-memory-scaling", "0"], "--device-memory-scaling"),
        (["--device-memory-scaling", "-1.5"], "--device-memory-scaling"),
        (["--device-memory-scaling", "nan"], "--device-memory-scaling"),
        (["--device-cores-scaling", "0"], "--device-cores-scaling"),
        (["--allocation-policy", "random"], "--allocation-policy"),
        (["--resource-name", "gpu"], "--resource-name"),
        (["--resource-name", "kubernetes.io/gpu"], "--resource-name"),
        (["--resource-name", "Example.com/gpu"], "--resource-name"),
        (["--socket-name", "a/b.sock"], "--socket-name"),
        (["--log-level", "loud"], "--log-level"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_invalid_flag(tmp_path: Path, args: list[str], option: str) -> None:
    r = run_cli(["--config", str(tmp_path / "none.toml"), "--state-dir", str(tmp_path), *args])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert option in lines[0]


def test_invalid_config_file_names_field(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[device_plugin]\ndevice_split_count = -3\n")
    r = run_cli(["--config", str(cfg)])
    assert r.returncode == 2
    assert "device_plugin.device_split_count" in r.stderr


def test_no_nvml_fails_clearly(tmp_path: Path) -> None:
    r = run_cli(
        ["--config", str(tmp_path / "none.toml"), "--state-dir", str(tmp_path), "--kubelet-dir", str(tmp_path)],
        env={"LD_LIBRARY_PATH": str(tmp_path)},
        timeout=120,
    )
    if r.returncode == 0:  # pragma: no cover - a host with a real driver
        pytest.skip("a real NVML is installed")
    assert r.returncode == 1
    assert "NVML" in r.stderr


def test_help_lists_every_config_field() -> None:
    r = run_cli(["--help"])
    assert r.returncode == 0
    for flag in (
        "--config",
        "--state-dir",
        "--log-level",
        "--resource-name",
        "--device-split-count",
        "--device-memory-scaling",
        "--device-cores-scaling",
        "--kubelet-dir",
        "--socket-name",
        "--allocation-policy",
        "--health-recovery-s",
        "--record-gc-grace-s",
        "--record-gc-interval-s",
        "--node-name",
    ):
        assert flag in r.stdout
