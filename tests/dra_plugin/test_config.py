"""The DRA plugin's settings are a view of the one node configuration (vgpu.config.NodeConfig):
its own `[dra]` section, the node's slicing from `[device_plugin]`, flags over both; the file the
device plugin reads is the same file."""

from __future__ import annotations

from pathlib import Path

import pytest

from dra_plugin.__main__ import build_parser, load, main
from dra_plugin.config import FIELDS, Settings
from vgpu import paths
from vgpu.config import NodeConfig, load_config

CONFIG = """
[common]
state_dir = "{state}"
[device_plugin]
device_split_count = 4
device_memory_scaling = 1.5
kubelet_dir = "/var/lib/k"
[dra]
memory_step = 536870912
cores_min = 5
cdi_dir = "/etc/cdi"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text.replace("{state}", str(tmp_path / "state")))
    return p


def test_one_file_for_both_front_ends(tmp_path: Path) -> None:
    p = write(tmp_path, CONFIG)
    cfg, _ = load(build_parser().parse_args(["--config", str(p)]))
    assert (cfg.slicing.split_count, cfg.slicing.memory_scaling, cfg.kubelet_dir) == (4, 1.5, "/var/lib/k")
    assert (cfg.memory_step, cfg.cores_min, cfg.cdi_dir) == (512 << 20, 5, "/etc/cdi")
    assert cfg.checkpoint_path == str(tmp_path / "state" / "dra" / "checkpoint.json")
    assert cfg.claims_dir == str(tmp_path / "state" / "claims")
    # the device plugin reads the same file ([dra] is a section of the node config, not an unknown one)
    node = load_config(str(p), missing_ok=False)
    assert node.device_plugin.device_split_count == 4 and node.dra.memory_step == 512 << 20


def test_flags_override_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, CONFIG)
    argv = ["--config", str(p), "--device-split-count", "2", "--memory-step", str(1 << 30), "--no-publish"]
    cfg, _ = load(build_parser().parse_args(argv))
    assert (cfg.slicing.split_count, cfg.memory_step, cfg.cores_min, cfg.publish) == (2, 1 << 30, 5, False)


@pytest.mark.parametrize(
    ("text", "argv", "field"),
    [
        ("[dra]\ncores_min = -1\n", [], "`dra.cores_min` (option --cores-min)"),
        ('[dra]\nnvidia_cdi_device = "serial"\n', [], "`dra.nvidia_cdi_device` (option --nvidia-cdi-device)"),
        ("", ["--memory-step", "0"], "`dra.memory_step` (option --memory-step)"),
        ("", ["--device-split-count", "0"], "`device_plugin.device_split_count` (option --device-split-count)"),
        ("[dra]\nbogus = 1\n", [], "field `dra`: Object contains unknown field `bogus`"),
    ],
)
def test_invalid_settings_exit_2_naming_field_and_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, argv: list[str], field: str
) -> None:
    p = write(tmp_path, text)
    assert main(["print", "--config", str(p), *argv]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err, err


def test_every_setting_has_its_place_in_the_node_config() -> None:
    defaults = Settings.from_node_config(NodeConfig())
    tree = NodeConfig().__struct_fields__
    for setting, dotted in FIELDS.items():
        section, field = dotted.split(".")
        assert section in tree and field in getattr(NodeConfig(), section).__struct_fields__, dotted
        assert hasattr(defaults, setting) or hasattr(defaults.slicing, setting), setting


@pytest.mark.parametrize(
    ("uid", "ok"),
    [
        ("3f2504e0-4f89-41d3-9a0c-0305e82c3301", True),
        ("3F2504E0-4F89-41D3-9A0C-0305E82C3301", False),  # the API server makes them lowercase
        ("3f2504e0-4f89-41d3-9a0c-0305e82c330", False),
        ("3f2504e0_4f89-41d3-9a0c-0305e82c3301", False),
        ("../../../../etc/passwd-00000000000000", False),
        ("", False),
    ],
)
def test_claim_uid_is_a_safe_path_component(uid: str, ok: bool) -> None:
    assert paths.valid_claim_uid(uid) is ok
    if not ok:
        with pytest.raises(paths.InvalidName):
            paths.Paths("/s").claim_dir(uid)
