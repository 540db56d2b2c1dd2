"""The hook's path stays lean (standard library only, no costly modules), and what it writes with
vgpu's contract modules (region, paths) refuses what does not fit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_hook import mounts
from vgpu import paths as vpaths
from vgpu import region
from vgpu.limits import DeviceLimit

ROOT = Path(__file__).resolve().parents[2]


def _lim(uuid: str, memory: int, cores: int) -> DeviceLimit:
    return DeviceLimit(uuid=uuid, memory_limit=memory, core_percent=cores, oversubscribe=False)


def test_region_rejects_what_does_not_fit(tmp_path: Path) -> None:
    ok = _lim("GPU-1", 1, 1)
    with pytest.raises(ValueError, match="too many devices"):
        region.render_header([ok] * 17, 0)
    with pytest.raises(ValueError, match="uuid too long"):
        region.render_header([_lim("G" * 96, 1, 1)], 0)
    for bad in (_lim("GPU-1", -1, 1), _lim("GPU-1", 1 << 64, 1), _lim("GPU-1", 1, 1 << 32)):
        with pytest.raises(ValueError, match="out of range"):
            region.render_header([bad], 0)


@pytest.mark.parametrize("sparse", [False, True])
def test_region_never_follows_a_symlinked_temp_file(tmp_path: Path, sparse: bool) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / f"region.tmp{os.getpid()}").symlink_to(victim)  # initialise's temp name
    with pytest.raises(OSError):
        region.initialise(str(tmp_path / "region"), [_lim("GPU-1", 1, 1)], sparse=sparse)
    assert victim.read_bytes() == b"keep"
    assert not (tmp_path / "region").exists()


@pytest.mark.parametrize("sparse", [False, True])
def test_region_files_are_whole_and_equal(tmp_path: Path, sparse: bool) -> None:
    lim = [_lim("GPU-1", 5 << 30, 30), DeviceLimit(uuid="GPU-2", memory_limit=1, core_percent=0, oversubscribe=True)]
    p = tmp_path / "region"
    region.initialise(str(p), lim, 0o640, sparse=sparse)
    assert p.stat().st_size == region.REGION_SIZE and p.stat().st_mode & 0o777 == 0o640
    data = p.read_bytes()
    assert data[region.SLOT_OFFSET :] == bytes(region.REGION_SIZE - region.SLOT_OFFSET)
    snap = region.parse(data)
    assert [(d.uuid, d.memory_limit, d.core_percent, d.oversubscribe) for d in snap.devices] == [
        ("GPU-1", 5 << 30, 30, False),
        ("GPU-2", 1, 0, True),
    ]
    assert snap.slots == [] and snap.created > 0
    assert sorted(os.listdir(tmp_path)) == ["region"]


# vgpu.paths lost `re` and `dataclasses` for the hook's sake: same rules, same class behaviour.
_TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")
_CID_RE = re.compile(r"^[A-Za-z0-9_+.-]{1,128}$")
_near = st.text(st.sampled_from("0123456789abcdefABz_+.-/\n é\x00"), max_size=140)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_near, st.text(max_size=140), st.text("0123456789abcdef", min_size=30, max_size=34)))
def test_paths_rules_equal_the_former_regexes(s: str) -> None:
    assert vpaths.valid_token(s) == bool(_TOKEN_RE.fullmatch(s))
    assert vpaths.valid_container_id(s) == (bool(_CID_RE.fullmatch(s)) and s not in (".", ".."))


def test_paths_behaves_as_the_frozen_dataclass_it_was() -> None:
    import copy
    import dataclasses
    import pickle

    p = vpaths.Paths("/s")
    assert p == vpaths.Paths(state_dir="/s") and p != vpaths.Paths("/t") and p != "/s"
    assert hash(p) == hash(vpaths.Paths("/s"))
    assert vpaths.Paths().state_dir == vpaths.DEFAULT_STATE_DIR and p.run_dir == ""
    assert p != vpaths.Paths("/s", "/run/vgpu") and vpaths.Paths("/s", "/r") == vpaths.Paths(
        state_dir="/s", run_dir="/r"
    )

    @dataclasses.dataclass(frozen=True)
    class Paths:  # what it was, with the run_dir the DRA plugin's claims added
        state_dir: str = vpaths.DEFAULT_STATE_DIR
        run_dir: str = ""

    for args in (("/s",), ("/s", "/r")):
        assert repr(vpaths.Paths(*args)) == repr(Paths(*args)).split("<locals>.")[-1]
    assert pickle.loads(pickle.dumps(p)) == p == copy.deepcopy(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.state_dir = "/t"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del p.state_dir
    match p:
        case vpaths.Paths(sd):
            assert sd == "/s"
    assert p.allocation_record("0" * 32) == "/s/allocations/" + "0" * 32 + ".json"
    with pytest.raises(vpaths.InvalidName):
        p.container_dir("..")
    with pytest.raises(TypeError):
        vpaths.valid_token(b"0" * 32)  # type: ignore[arg-type]


def test_sigkill_constant() -> None:
    import signal

    assert mounts.SIGKILL == signal.SIGKILL


def test_hook_path_imports_stay_lean() -> None:
    """What a vGPU prestart imports under `python -I -S`: none of the modules that used to cost it ~30 ms."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import runtime_hook.fastpath, runtime_hook.main, runtime_hook.prestart, runtime_hook.poststop; "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(ROOT)], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    heavy = {"re", "dataclasses", "inspect", "enum", "signal", "typing", "logging", "msgspec", "json"}
    assert heavy.isdisjoint(out), sorted(heavy.intersection(out))
    assert {"vgpu.schemas", "vgpu.statedir"} <= set(out)


def _prestart_up_to_the_record(tmp_path: Path, hook_flags: list[str]) -> tuple[int, str, set[str], list[str]]:
    """runtime_hook.main for a vGPU container's prestart under `python -I -S`, as installed, up to the
    record lookup (an unknown token: fails closed); rc, stderr, the modules loaded, sys.path."""
    from tests.support import hook as support

    bundle = tmp_path / "b"
    support.make_bundle(bundle, ["true"], env=[f"VGPU_ALLOCATION_TOKEN={'0' * 32}"])
    st = {"ociVersion": "1.0.2", "id": "c1", "pid": os.getpid(), "status": "creating", "bundle": str(bundle)}
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[1:]; "
        "from runtime_hook import main; rc = main.main(); "
        "print('MODULES', rc, ' '.join(sorted(sys.modules))); print('PATH', *sys.path)"
    )
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(ROOT), *hook_flags, "prestart"],
        input=json.dumps(st).encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    out = r.stdout.decode().splitlines()
    line = next(x for x in out if x.startswith("MODULES")).split()
    path = next(x for x in out if x.startswith("PATH")).split()[1:]
    return int(line[1]), r.stderr.decode(), set(line[2:]), path


def test_vgpu_prestart_with_every_setting_in_flags_never_runs_site(tmp_path: Path) -> None:
    """The installed hook has every setting in its flags: a vGPU prestart parses no config, so it
    needs no site-packages: neither the host python's `site.main()` (~6 ms) nor a venv's
    site-packages on sys.path."""
    from tests.support import hook as support

    args = support.hook_args("prestart", state_dir=tmp_path / "state", library=tmp_path / "lib.so", log_dir=tmp_path)
    rc, err, mods, path = _prestart_up_to_the_record(tmp_path, args[4:-1])
    assert rc == 1 and "unknown vGPU allocation token" in err, err
    assert "runtime_hook.prestart" in mods  # it got as far as the vGPU path
    assert "site" not in mods
    assert not [x for x in path if x.endswith(("site-packages", "dist-packages"))], path
    assert {"msgspec", "vgpu.config"}.isdisjoint(mods)


def test_vgpu_prestart_reading_the_node_config_gets_site_packages(tmp_path: Path) -> None:
    """Without every setting in its flags the hook parses the node config (vgpu.config: msgspec,
    TOML): site-packages become importable for that, and the config's state_dir is the one used."""
    state = tmp_path / "state-from-config"
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[common]\nstate_dir = "{state}"\n[hook]\nlog_dir = "{tmp_path}"\n')
    rc, err, mods, _ = _prestart_up_to_the_record(tmp_path, ["--config", str(cfg)])
    assert rc == 1 and "unknown vGPU allocation token" in err, err
    assert str(state) in err  # the record was looked for where the config says
    assert {"msgspec", "vgpu.config", "runtime_hook.prestart"} <= mods
