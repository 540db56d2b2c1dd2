"""packaging/config.toml (the shipped /etc/vgpu/config.toml) is the schema, field for field.

Every field of vgpu.config.NodeConfig appears, in its section, with its built-in default and a
comment directly above it; nothing else appears.  A field added to the schema without its line
here fails this test.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from vgpu.config import NodeConfig, load_config

CONFIG = Path(__file__).resolve().parents[2] / "packaging" / "config.toml"


def _schema() -> dict[str, dict[str, object]]:
    return msgspec.to_builtins(NodeConfig())  # type: ignore[no-any-return]


def test_loads_to_the_defaults() -> None:
    assert load_config(str(CONFIG), missing_ok=False) == NodeConfig()


def test_has_every_field_and_nothing_else() -> None:
    tree = msgspec.toml.decode(CONFIG.read_bytes())
    schema = _schema()
    assert list(tree) == list(schema)
    for section, fields in schema.items():
        assert sorted(tree[section]) == sorted(fields), section
        for name, default in fields.items():
            assert tree[section][name] == default, f"{section}.{name}"
            assert type(tree[section][name]) is type(default), f"{section}.{name}: write {default!r}"


def test_every_field_is_documented() -> None:
    lines = CONFIG.read_text().splitlines()
    assignment = re.compile(r"^([a-z_]+) = ")
    seen = 0
    for i, line in enumerate(lines):
        m = assignment.match(line)
        if m:
            seen += 1
            assert i > 0 and lines[i - 1].startswith("# "), f"`{m.group(1)}` has no comment above it"
    assert seen == sum(len(f) for f in _schema().values())
