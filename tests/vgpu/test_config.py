from __future__ import annotations

from pathlib import Path

import pytest

from vgpu import config


def test_defaults_when_file_missing(tmp_path: Path) -> None:
    cfg = config.load_config(str(tmp_path / "absent.toml"))
    assert cfg.device_plugin.device_split_count == 2
    assert cfg.device_plugin.device_memory_scaling == 1.0
    assert cfg.monitor.metrics_port == 9394
    assert cfg.monitor.policy == "contended"
    assert cfg.paths.allocations_dir == "/var/lib/vgpu/allocations"


def test_file_and_flag_override(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[device_plugin]\ndevice_split_count = 4\n[common]\nstate_dir = '/tmp/x'\n")
    cfg = config.load_config(str(p), {"device_plugin.device_split_count": 8, "monitor.policy": None})
    assert cfg.device_plugin.device_split_count == 8
    assert cfg.common.state_dir == "/tmp/x"
    assert cfg.monitor.policy == "contended"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[device_plugin]\ndevice_split_count = 0\n", "device_plugin.device_split_count"),
        ("[device_plugin]\ndevice_memory_scaling = -1.0\n", "device_plugin.device_memory_scaling"),
        ("[monitor]\npolicy = 'greedy'\n", "monitor.policy"),
        ("[monitor]\nbogus = 1\n", "monitor"),
    ],
)
def test_invalid_field_is_named(tmp_path: Path, text: str, field: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load_config(str(p))
    assert field in str(e.value)


def test_invalid_override_is_named() -> None:
    with pytest.raises(config.ConfigError) as e:
        config.load_config(None, {"monitor.metrics_port": 70000})
    assert "monitor.metrics_port" in str(e.value)


def test_unparseable_toml(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[device_plugin\n")
    with pytest.raises(config.ConfigError) as e:
        config.load_config(str(p))
    assert str(p) in str(e.value)
