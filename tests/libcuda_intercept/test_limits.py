"""The limits file: libvgpu.so's C parser agrees with vgpu/limits.py, and a
bad file fails closed (cuInit refuses, one stderr line names file and problem)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.libcuda_intercept.support import BUILD, UUID0, UUID1, Node
from vgpu import limits as L


def c_parse(path: Path) -> list[L.DeviceLimit] | str:
    p = subprocess.run(
        [str(BUILD / "intercept" / "limits_check"), str(path)], capture_output=True, text=True, timeout=30
    )
    lines = p.stdout.splitlines()
    if p.returncode != 0:
        assert lines and lines[0].startswith("error "), p.stdout
        return lines[0][6:]
    out = []
    for ln in lines[1:]:
        _, uuid, mem, pct, ov, dev = ln.split()
        out.append(
            L.DeviceLimit(
                uuid=uuid, memory_limit=int(mem), core_percent=int(pct), oversubscribe=ov == "1", device_limit=int(dev)
            )
        )
    return out


def py_parse(text: str) -> list[L.DeviceLimit] | None:
    try:
        return L.parse(text)
    except L.LimitsError:
        return None


CASES = {
    "ok": (f"vgpu-limits 1\n{UUID0} 8589934592 50 0\n", True),
    "two": (f"vgpu-limits 1\n{UUID0} 1 1 0\n{UUID1} 2 100 0\n", True),
    "v1 oversubscribed": (f"vgpu-limits 1\n{UUID0} 1 1 1\n{UUID1} 2 100 0\n", False),
    "v2": (f"vgpu-limits 2\n{UUID0} 17179869184 50 1 8589934592\n{UUID1} 2 100 0 2\n", True),
    "v2 share = slice": (f"vgpu-limits 2\n{UUID0} 1024 50 1 1024\n", True),
    "v2 share zero": (f"vgpu-limits 2\n{UUID0} 1024 50 1 0\n", True),
    "v2 share above slice": (f"vgpu-limits 2\n{UUID0} 1024 50 1 1025\n", False),
    "v2 share below slice without oversubscription": (f"vgpu-limits 2\n{UUID0} 1024 50 0 512\n", False),
    "v2 four fields": (f"vgpu-limits 2\n{UUID0} 1024 50 0\n", False),
    "v1 five fields": (f"vgpu-limits 1\n{UUID0} 1024 50 0 1024\n", False),
    "v2 bad share": (f"vgpu-limits 2\n{UUID0} 1024 50 1 1k\n", False),
    "comments": (f"# made by vgpu-hook\nvgpu-limits 1\n\n# dev\n{UUID0} 1024 50 0\n", True),
    "crlf": (f"vgpu-limits 1\r\n{UUID0} 1024 50 0\r\n", True),
    "no devices": ("vgpu-limits 1\n", True),
    "u64 max": (f"vgpu-limits 1\n{UUID0} 18446744073709551615 50 0\n", True),
    "version 3": (f"vgpu-limits 3\n{UUID0} 1024 50 0 1024\n", False),
    "no header": (f"{UUID0} 1024 50 0\n", False),
    "empty": ("", False),
    "negative": (f"vgpu-limits 1\n{UUID0} -1 50 0\n", False),
    "overflow": (f"vgpu-limits 1\n{UUID0} 18446744073709551616 50 0\n", False),
    "suffix": (f"vgpu-limits 1\n{UUID0} 8g 50 0\n", False),
    "flag 2": (f"vgpu-limits 1\n{UUID0} 1024 50 2\n", False),
    "extra field": (f"vgpu-limits 1\n{UUID0} 1024 50 0 x\n", False),
    "short": (f"vgpu-limits 1\n{UUID0} 1024 50\n", False),
    "duplicate": (f"vgpu-limits 1\n{UUID0} 1 1 0\n{UUID0.lower()} 2 2 0\n", False),
    "bad uuid": ("vgpu-limits 1\nGPU/../x 1024 50 0\n", False),
    "17 devices": ("vgpu-limits 1\n" + "".join(f"GPU-{i} 1 1 0\n" for i in range(17)), False),
    "percent": (f"vgpu-limits 1\n{UUID0} 1024 10001 0\n", False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_c_and_python_parsers_agree(tmp_path: Path, build_dir: Path, name: str) -> None:
    text, valid = CASES[name]
    f = tmp_path / "limits"
    f.write_text(text)
    c = c_parse(f)
    py = py_parse(text)
    if valid:
        assert c == py and py is not None, (c, py)
    else:
        assert isinstance(c, str) and py is None, (c, py)


TOKENS = [
    "vgpu-limits",
    "1",
    "2",
    "3",
    "0",
    UUID0,
    UUID1,
    "GPU-x",
    "#",
    "18446744073709551615",
    "99999999999999999999",
    "50",
    "-3",
    "1k",
    " ",
    "  ",
    "\t",
    "\n",
    "\n",
    "\n",
    "\r\n",
    "#c\n",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(TOKENS), max_size=30), st.sampled_from(["", "vgpu-limits 1\n", "vgpu-limits 2\n"]))
def test_fuzz_parsers_agree(tmp_path: Path, build_dir: Path, toks: list[str], header: str) -> None:
    text = header + " ".join(toks)
    f = tmp_path / "limits"
    f.write_text(text)
    c = c_parse(f)
    py = py_parse(text)
    if py is None:
        assert isinstance(c, str), (text, c)
    else:
        assert c == py, (text, c, py)


@pytest.mark.parametrize(
    "content,needle",
    [
        ("vgpu-limits 3\nGPU-x 1 1 0 1\n", "unknown limits version"),
        ("vgpu-limits 1\nGPU-x 2 1 1\n", "do not carry the physical share"),
        ("GPU-x 1 1 0\n", "header"),
        ("vgpu-limits 1\nGPU-x lots 1 0\n", "malformed"),
        (None, "does not exist"),
        ("dir", "not a regular file"),
    ],
)
def test_bad_limits_file_fails_closed(node: Node, content: str | None, needle: str) -> None:
    if content is None:
        node.limits.unlink(missing_ok=True)
    elif content == "dir":
        node.limits.unlink(missing_ok=True)
        node.limits.mkdir()
    else:
        node.limits.write_text(content)
    for mode in ("gpa", "link"):
        r = node.cutest(mode, "init", "alloc", 1024)
        assert r.one("init")["rc"] == "800", r.out  # CUDA_ERROR_NOT_PERMITTED
        assert not r.all("alloc")
        errs = [ln for ln in r.err.splitlines() if ln.strip()]
        assert len(errs) == 1, r.err
        assert str(node.limits) in errs[0] and needle in errs[0] and "fail closed" in errs[0]
    # silent when asked to be
    r = node.cutest("gpa", "init", env={"VGPU_LOG_LEVEL": "off"})
    assert r.one("init")["rc"] == "800" and r.err == ""


def test_unreadable_limits_file_fails_closed(node: Node) -> None:
    node.limit(1 << 30)
    node.limits.chmod(0)
    # root reads anything: run the program as nobody
    argv = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        str(BUILD / "intercept" / "cutest"),
        "gpa",
        "init",
    ]
    r = subprocess.run(argv, env=node.env(), capture_output=True, text=True, timeout=60)
    if "Operation not permitted" in r.stderr and "setpriv" in r.stderr:
        pytest.skip("cannot drop privileges here")
    assert "init rc=800" in r.stdout, (r.stdout, r.stderr)
    assert "Permission denied" in r.stderr and str(node.limits) in r.stderr
