"""CDI specs in the node's spec directories: each spec's kind and device names (`parse_spec` is
pure; JSON, or YAML by a line scan: no YAML library on the installer's path)."""

from __future__ import annotations

import json
import os

from node_setup.nodetype.facts import CDISpec
from node_setup.nodetype.root import DetectError, Root


def yaml_scan(text: str) -> tuple[str, list[str]]:
    """kind and device names of a CDI YAML spec, by a line scan (no YAML library here)."""
    kind = ""
    names: list[str] = []
    in_devices = False
    dev_indent: int | None = None
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0 and not s.startswith("- "):
            in_devices = s.startswith("devices:")
            if s.startswith("kind:"):
                kind = s[5:].strip().strip("'\"")
            continue
        if not in_devices:
            continue
        if s.startswith("- "):
            if dev_indent is None:
                dev_indent = indent
            if indent == dev_indent and s[2:].lstrip().startswith("name:"):
                names.append(s[2:].lstrip()[5:].strip().strip("'\""))
        elif dev_indent is not None and indent == dev_indent + 2 and s.startswith("name:"):
            names.append(s[5:].strip().strip("'\""))
    return kind, names


def read_cdi_specs(root: Root, dirs: list[str]) -> list[CDISpec]:
    """Every *.json, *.yaml, *.yml spec in `dirs` (host paths, each file once, in order)."""
    out = []
    seen = set()
    for d in dirs:
        for path in root.glob(os.path.join(d, "*")):
            if path in seen or not path.endswith((".json", ".yaml", ".yml")):
                continue
            seen.add(path)
            try:
                text = root.read(path) or ""
            except DetectError as e:
                out.append(CDISpec(path=path, error=str(e)))
                continue
            out.append(parse_spec(path, text))
    return out


def parse_spec(path: str, text: str) -> CDISpec:
    """Kind and device names of one spec (`error` when it names no kind or is not JSON)."""
    spec = CDISpec(path=path)
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
            spec.kind = str(doc.get("kind", ""))
            spec.devices = [str(x.get("name", "")) for x in doc.get("devices") or [] if isinstance(x, dict)]
        except (ValueError, AttributeError) as e:
            spec.error = f"invalid JSON: {e}"
    else:
        spec.kind, spec.devices = yaml_scan(text)
    if not spec.kind and not spec.error:
        spec.error = "no kind"
    return spec
