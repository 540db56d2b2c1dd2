"""`vgpu-hook hooksd install | uninstall | print`: the OCI hooks.d entries for CRI-O and podman."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from node_setup import hookcmd as cli
from node_setup.hooksd import plan as hooksd
from node_setup.hookspec import HOOK_ENV

pytestmark = pytest.mark.timeout(60)


def _run(tmp: Path, *args: str) -> int:
    return cli.main(["--config", str(tmp / "none.toml"), "--state-dir", str(tmp / "state"), "hooksd", *args])


def test_entries_schema_and_conditions(tmp_path: Path) -> None:
    d = tmp_path / "hooks.d"
    assert _run(tmp_path, "install", "--dir", str(d), "--python", "/usr/bin/python3") == 0
    assert sorted(p.name for p in d.iterdir()) == ["vgpu-poststop.json", "vgpu.json"]
    for name, stage in (("vgpu.json", "prestart"), ("vgpu-poststop.json", "poststop")):
        doc = json.loads((d / name).read_text())
        assert set(doc) == {"version", "hook", "when", "stages"} and doc["version"] == "1.0.0"
        assert doc["stages"] == [stage]
        hook = doc["hook"]
        assert hook["path"] == "/bin/sh" and hook["args"][3:5] == ["vgpu-hook", stage]
        assert hook["env"] == HOOK_ENV and hook["timeout"] == 30  # never the image's env
        assert "/usr/bin/python3" in hook["args"] and hook["args"][-1] == stage
        assert "--state-dir" in hook["args"] and str(tmp_path / "state") in hook["args"]
        ((key, value),) = doc["when"]["annotations"].items()
        # hooks.d matches with Go regexps (RE2): these are plain enough for Python's re to agree.
        assert re.search(key, "vgpu.k8s.io/allocation-token") and not re.search(key, "vgpuXk8s.io/allocation-token")
        assert not re.search(key, "x-vgpu.k8s.io/allocation-token-y")
        assert re.search(value, "0" * 32) and not re.search(value, "0" * 31) and not re.search(value, "../x")
    assert _run(tmp_path, "install", "--dir", str(d), "--python", "/usr/bin/python3") == 0  # idempotent
    assert _run(tmp_path, "uninstall", "--dir", str(d)) == 0
    assert list(d.iterdir()) == []


def test_hook_command_is_the_installed_filter(tmp_path: Path) -> None:
    """The prestart entry is the sh filter: a token-less state exits 0 without starting Python."""
    d = tmp_path / "hooks.d"
    assert _run(tmp_path, "install", "--dir", str(d), "--python", "/bin/false") == 0
    hook = json.loads((d / "vgpu.json").read_text())["hook"]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text('{"process":{"env":["PATH=/bin"]}}')
    state = json.dumps({"id": "c1", "bundle": str(bundle)}, separators=(",", ":")).encode()
    r = subprocess.run(hook["args"], input=state, env=dict(e.split("=", 1) for e in hook["env"]), capture_output=True)
    assert r.returncode == 0  # /bin/false (the "interpreter") never ran
    ann = {hooksd.TOKEN_ANNOTATION: "0" * 32}
    tokened = json.dumps({"id": "c1", "bundle": str(bundle), "annotations": ann}).encode()
    r = subprocess.run(hook["args"], input=tokened, env=dict(e.split("=", 1) for e in hook["env"]))
    assert r.returncode != 0  # handed to the interpreter (here /bin/false)


def test_foreign_file_is_never_overwritten_or_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "hooks.d"
    d.mkdir()
    (d / "vgpu.json").write_text('{"version": "1.0.0", "hook": {"path": "/opt/other"}}')
    assert _run(tmp_path, "install", "--dir", str(d)) == 1
    assert "not ours" in capsys.readouterr().err
    assert _run(tmp_path, "uninstall", "--dir", str(d)) == 0
    assert (d / "vgpu.json").read_text().startswith('{"version"')


def test_root_and_print(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = tmp_path / "host"
    assert _run(tmp_path, "print", "--root", str(host)) == 1  # this interpreter is not the host's
    (host / "usr/local/vgpu").mkdir(parents=True)
    (host / "usr/local/vgpu/python3").write_text("")
    (host / "usr/local/vgpu/fastpath.py").write_text("")
    py = ["--python", "/usr/local/vgpu/python3", "--hook-path", "/usr/local/vgpu/fastpath.py"]
    assert _run(tmp_path, "print", "--root", str(host), *py) == 0
    out = capsys.readouterr().out
    assert f"# {hooksd.DEFAULT_DIR}/vgpu.json" in out and not (host / "usr/share").exists()
    assert _run(tmp_path, "install", "--root", str(host), *py) == 0
    doc = json.loads((host / hooksd.DEFAULT_DIR.lstrip("/") / "vgpu.json").read_text())
    assert "/usr/local/vgpu/fastpath.py" in doc["hook"]["args"]
