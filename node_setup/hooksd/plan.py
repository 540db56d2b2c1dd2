"""The hooks.d entries, as {host path: text} (pure)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from node_setup.hookspec import HookOptions, is_ours

DEFAULT_DIR = "/usr/share/containers/oci/hooks.d"
TOKEN_ANNOTATION = "vgpu.k8s.io/allocation-token"
FILES = {"prestart": "vgpu.json", "poststop": "vgpu-poststop.json"}
# hooks.d `when.annotations`: key regex -> value regex (Go RE2, matched unanchored: anchor them).
WHEN = {"^" + TOKEN_ANNOTATION.replace(".", r"\.") + "$": "^[0-9a-f]{32}$"}


@dataclass(frozen=True)
class Options:
    """`vgpu-hook hooksd ...` (node_setup.hookcmd turns the flags into these)."""

    hook: HookOptions
    directory: str = DEFAULT_DIR  # host path of the hooks.d directory, absolute
    root: str = "/"  # the host's / (files are written under it)


def entries(hook: HookOptions) -> dict[str, dict[str, Any]]:
    """{file name: hooks.d 1.0.0 document}."""
    hooks = hook.entries()
    out = {}
    for stage, name in FILES.items():
        out[name] = {
            "version": "1.0.0",
            "hook": hooks[stage],
            "when": {"annotations": dict(WHEN)},
            "stages": [stage],
        }
    return out


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"


def files(opts: Options) -> dict[str, str]:
    """{host path: text} of the entries."""
    return {os.path.join(opts.directory, name): render(doc) for name, doc in entries(opts.hook).items()}


def is_our_entry(text: str | None) -> bool:
    """Whether a hooks.d file is one of ours (its hook is our command)."""
    if text is None:
        return False
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and is_ours(doc.get("hook"))
