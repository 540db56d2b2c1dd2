"""Fuzzing the hook's input handling: malformed OCI state, config.json, records, argv.

In-process (fast, >= 10,000 cases in all) over the pure decision and parsing
functions, plus a few hundred real hook processes fed the same kind of input.
Properties: no exception escapes (no traceback), exit codes as specified
(0 = left alone, 1 = refused with exactly one `vgpu-hook:` line on stderr),
and a container that shows no token is never refused.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime_hook import oci, prestart
from runtime_hook import settings as hook_settings
from tests.support import hook as support
from vgpu import paths as vpaths

pytestmark = pytest.mark.timeout(300)

TOKEN = "0123456789abcdef0123456789abcdef"
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)
)
json_any = st.recursive(
    json_leaf,
    lambda ch: st.one_of(st.lists(ch, max_size=4), st.dictionaries(st.text(max_size=12), ch, max_size=4)),
    max_leaves=6,
)
token_str = st.one_of(st.just(TOKEN), st.text(max_size=40), st.just(""), st.just("../../etc/passwd"))


@st.composite
def states(draw: Any) -> tuple[bytes, bool]:
    """(stdin bytes, whether the state itself carries a token annotation)."""
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=200)), False
    if kind == 1:
        return json.dumps(draw(json_any)).encode(), False
    ann: dict[str, Any] = draw(
        st.dictionaries(st.sampled_from(["a", "io.kubernetes.cri.sandbox-name"]), st.text(max_size=8))
    )
    has = draw(st.booleans())
    if has:
        ann[oci.TOKEN_ANNOTATION] = draw(token_str)
    obj: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "id": draw(st.one_of(st.just("c1"), st.text(max_size=20), json_leaf)),
        "pid": draw(st.one_of(st.integers(-5, 1 << 23), json_leaf)),
        "bundle": draw(st.one_of(st.just("/bundle"), st.text(max_size=20), json_leaf)),
        "status": "creating",
        "annotations": ann if kind != 5 else draw(json_any),
    }
    for k in draw(st.lists(st.sampled_from(list(obj)), max_size=2)):
        obj.pop(k, None)
    data = json.dumps(obj).encode()
    if kind == 4 and data:  # truncate or corrupt one byte
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + draw(st.binary(max_size=3))
    return data, has


@st.composite
def specs(draw: Any) -> bytes | OSError:
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return OSError(2, "No such file or directory")
    if kind == 1:
        return draw(st.binary(max_size=200))
    if kind == 2:
        return json.dumps(draw(json_any)).encode()
    env = draw(
        st.lists(
            st.one_of(st.text(max_size=20), st.sampled_from(["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]), json_leaf),
            max_size=4,
        )
    )
    if draw(st.booleans()):
        env.append(f"{oci.TOKEN_ENV}={draw(token_str)}")
    spec: dict[str, Any] = {
        "process": draw(st.one_of(st.just({"env": env}), json_any)),
        "root": draw(st.one_of(st.just({"path": "rootfs", "readonly": True}), json_any)),
        "annotations": draw(st.one_of(st.just({}), json_any)),
    }
    data = json.dumps(spec).encode()
    if kind == 4 and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + draw(st.binary(max_size=3))
    return data


def _marked(b: bytes) -> bool:
    return oci.TOKEN_ENV.encode() in b or oci.TOKEN_ANNOTATION.encode() in b


@settings(max_examples=3000, deadline=None, database=None)
@given(state=states(), spec=specs())
def test_decide_prestart_never_raises(state: tuple[bytes, bool], spec: bytes | OSError) -> None:
    data, _ = state

    def read(bundle: str) -> bytes:
        if isinstance(spec, OSError):
            raise spec
        return spec

    d = oci.decide_prestart(data, read)
    assert isinstance(d, (oci.Skip, oci.Fail, oci.Proceed))
    spec_bytes = b"" if isinstance(spec, OSError) else spec
    if isinstance(d, oci.Fail):
        assert d.message and "\n" not in d.message
        assert _marked(data) or _marked(spec_bytes), "refused a container without a token"
    if isinstance(d, oci.Proceed):
        assert isinstance(d.token, str)
        # The rest of the pure pipeline on whatever the spec holds: HookError or a value, nothing else.
        oci.visible_devices_outside(d.spec, {"GPU-x"})
        oci.pod_info(d.state.annotations)
        oci.cgroup_path(d.spec)
        oci.rootfs_readonly(d.spec)
        try:
            oci.rootfs_path(d.spec, d.state.bundle)
        except oci.HookError:
            pass


@settings(max_examples=1500, deadline=None, database=None)
@given(data=st.one_of(st.binary(max_size=100), json_any.map(lambda v: json.dumps(v).encode())))
def test_poststop_state_parsing(data: bytes) -> None:
    try:
        cid = oci.parse_poststop_id(data)
    except ValueError:
        return
    assert isinstance(cid, str)


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    content=st.one_of(
        st.binary(max_size=200),
        json_any.map(lambda v: json.dumps(v).encode()),
        st.builds(
            lambda t, g: json.dumps({"version": 1, "token": t, "created": 1.0, "gpus": g}).encode(),
            st.sampled_from([TOKEN, "f" * 32, 5]),
            st.lists(
                st.fixed_dictionaries(
                    {
                        "uuid": st.text(max_size=8),
                        "memory_limit": st.integers(-1, 2**65),
                        "core_percent": st.integers(-1, 20000),
                    }
                ),
                max_size=3,
            ),
        ),
    )
)
def test_record_loading_fails_closed(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    d = tmp_path_factory.getbasetemp() / "records"
    p = vpaths.Paths(str(d))
    os.makedirs(p.allocations_dir, exist_ok=True)
    with open(p.allocation_record(TOKEN), "wb") as f:
        f.write(content)
    try:
        rec = prestart.load_record(p, TOKEN)
    except oci.HookError as e:
        assert "\n" not in str(e).strip()
        return
    assert rec.token == TOKEN and rec.gpus


@settings(max_examples=2500, deadline=None, database=None)
@given(
    argv=st.lists(
        st.one_of(st.text(max_size=12), st.sampled_from(["--config", "--state-dir", "prestart", "--x=1", "-h"])),
        max_size=6,
    )
)
def test_argv_scan_never_raises(argv: list[str]) -> None:
    cmd, opts = hook_settings.scan_argv(argv)
    assert cmd is None or cmd in argv
    assert all(isinstance(v, str) for v in opts.values())


# ---- real hook processes ------------------------------------------------------------------


def _hook(tmp: Path, kind: str, stdin: bytes, shell: bool = False) -> subprocess.CompletedProcess[bytes]:
    """Run the hook as installed: Python directly, or behind the sh filter."""
    args = support.hooks(tmp / "state", tmp / "lib.so", tmp / "log", shell=shell)[kind][0]["args"]
    return subprocess.run(args, input=stdin, capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("shell", [False, True], ids=["python", "shell-filter"])
@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states(), spec=specs())
def test_hook_process_prestart(
    tmp_path_factory: pytest.TempPathFactory, shell: bool, state: tuple[bytes, bool], spec: bytes | OSError
) -> None:
    tmp = tmp_path_factory.mktemp("fz")
    bundle = tmp / "bundle"
    bundle.mkdir()
    if not isinstance(spec, OSError):
        (bundle / "config.json").write_bytes(spec)
    data, _ = state
    # Point the state at this bundle when it names the placeholder one.
    data = data.replace(b'"/bundle"', json.dumps(str(bundle)).encode())
    r = _hook(tmp, "prestart", data, shell)
    err = r.stderr.decode("utf-8", "replace")
    assert b"Traceback" not in r.stderr, err
    assert r.returncode in (0, 1), (r.returncode, err)
    spec_bytes = b"" if isinstance(spec, OSError) else spec
    if r.returncode == 1:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("vgpu-hook: "), err
        assert _marked(data) or _marked(spec_bytes)
    else:
        assert err == "", err


@pytest.mark.parametrize("shell", [False, True], ids=["python", "shell-filter"])
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.one_of(
        st.binary(max_size=80),
        st.builds(lambda i: json.dumps({"id": i}).encode(), st.text(max_size=20)),
        st.builds(  # compact, as runc writes it: the sh filter parses these itself
            lambda i: json.dumps({"ociVersion": "1.0.2", "id": i, "status": "stopped"}, separators=(",", ":")).encode(),
            st.one_of(st.text(max_size=20), st.sampled_from(["victim-sibling", "..", "../victim", "a/b", ".", ""])),
        ),
    )
)
def test_hook_process_poststop(tmp_path_factory: pytest.TempPathFactory, shell: bool, data: bytes) -> None:
    tmp = tmp_path_factory.mktemp("fzp")
    victim = tmp / "victim"
    victim.mkdir()
    (tmp / "state" / "containers" / "victim-sibling").mkdir(parents=True)
    r = _hook(tmp, "poststop", data, shell)
    assert r.returncode == 0 and b"Traceback" not in r.stderr
    assert victim.exists()
    try:
        cid = json.loads(data).get("id")
    except (ValueError, AttributeError):
        cid = None
    assert (tmp / "state" / "containers" / "victim-sibling").exists() or cid == "victim-sibling"


def test_hook_process_token_without_record_is_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"process": {"env": [f"{oci.TOKEN_ENV}={secrets.token_hex(16)}"]}}))
    r = _hook(tmp_path, "prestart", json.dumps({"id": "x", "pid": os.getpid(), "bundle": str(bundle)}).encode())
    assert r.returncode == 1 and r.stderr.decode().startswith("vgpu-hook: unknown vGPU allocation token")
    assert sys.executable
