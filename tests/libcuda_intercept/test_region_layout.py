"""vgpu/region.py spells libcuda_intercept/include/vgpu_region.h field for field."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.libcuda_intercept.support import ROOT, cc
from vgpu import region as R

HEADER = ROOT / "libcuda_intercept" / "include" / "vgpu_region.h"

CONSTANTS = {
    "VGPU_REGION_MAGIC": R.MAGIC,
    "VGPU_REGION_VERSION": R.VERSION,
    "VGPU_MAX_DEVICES": R.MAX_DEVICES,
    "VGPU_MAX_SLOTS": R.MAX_SLOTS,
    "VGPU_UUID_LEN": R.UUID_LEN,
    "VGPU_REGION_LOCK_BYTE": R.LOCK_BYTE,
    "VGPU_REGION_SLOT_LOCK_BASE": R.SLOT_LOCK_BASE,
    "VGPU_SLOT_FREE": R.SLOT_FREE,
    "VGPU_SLOT_ACTIVE": R.SLOT_ACTIVE,
    "VGPU_DEV_OVERSUBSCRIBE": R.DEV_OVERSUBSCRIBE,
    "VGPU_MAX_SHARED": R.MAX_SHARED,
    "VGPU_SHARED_FREE": R.SHARED_FREE,
    "VGPU_SHARED_LIVE": R.SHARED_LIVE,
    "VGPU_SHARED_KEYS": R.SHARED_KEYS,
    "VGPU_SHARED_FDS": R.SHARED_FDS,
}


def _c_program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{HEADER}"', "int main(void) {"]
    for cname, fields in R.STRUCTS.items():
        lines.append(f'printf("sizeof {cname} %zu\\n", sizeof(struct {cname}));')
        lines.append(f'printf("alignof {cname} %zu\\n", _Alignof(struct {cname}));')
        for fname, *_ in fields:
            lines.append(f'printf("offsetof {cname}.{fname} %zu\\n", offsetof(struct {cname}, {fname}));')
            lines.append(f'printf("fieldsize {cname}.{fname} %zu\\n", sizeof(((struct {cname} *)0)->{fname}));')
    for k in CONSTANTS:
        lines.append(f'printf("const {k} %llu\\n", (unsigned long long)({k}));')
    lines.append("return 0; }")
    return "\n".join(lines)


def test_every_offset_and_size_matches(tmp_path: Path) -> None:
    src = tmp_path / "layout.c"
    src.write_text(_c_program())
    exe = tmp_path / "layout"
    subprocess.run([cc(), "-std=c11", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True, timeout=120)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=30).stdout
    c: dict[str, int] = {}
    for ln in out.splitlines():
        kind, name, val = ln.split()
        c[f"{kind} {name}"] = int(val)
    checked = 0
    for cname in R.STRUCTS:
        size, align, fields = R.layout(cname)
        assert (c[f"sizeof {cname}"], c[f"alignof {cname}"]) == (size, align), cname
        for fname, (off, fsize) in fields.items():
            assert c[f"offsetof {cname}.{fname}"] == off, f"{cname}.{fname}"
            assert c[f"fieldsize {cname}.{fname}"] == fsize, f"{cname}.{fname}"
            checked += 1
    for k, v in CONSTANTS.items():
        assert c[f"const {k}"] == v, k
    assert checked >= 30
    assert c["sizeof vgpu_region"] == R.REGION_SIZE
    assert c["offsetof vgpu_region.slots"] == R.SLOT_OFFSET and c["offsetof vgpu_slot.dev"] == R.SLOT_DEV_OFFSET
    assert c["offsetof vgpu_region.created"] == R.CREATED_OFFSET
    assert c["offsetof vgpu_slot_device.extra_bytes"] == R.EXTRA_BYTES_OFFSET


def test_python_fields_cover_the_header() -> None:
    """A field added to the header but not to region.py shows up as a size mismatch above;
    this checks the names too, so a rename cannot slip through with the same layout."""
    text = HEADER.read_text()
    for cname, fields in R.STRUCTS.items():
        body = text.split(f"struct {cname} {{", 1)[1].split("};", 1)[0]
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        names = [decl.split("[", 1)[0].split()[-1] for decl in body.split(";") if decl.strip()]
        assert names == [f[0] for f in fields], cname
