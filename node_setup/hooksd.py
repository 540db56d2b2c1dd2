"""`vgpu-hook hooksd install | uninstall | print`: OCI hooks.d entries for CRI-O and podman.

CRI-O and podman read hook definitions from hooks.d directories (schema 1.0.0 of
containers/common `pkg/hooks`, docs/containers-hooks.5): one JSON file per hook, injected
into a container's spec when its `when` conditions match.  We write two:

- `vgpu.json`: the prestart hook, `when.annotations` on our token annotation
  (`vgpu.k8s.io/allocation-token`), so only containers carrying a token get it;
- `vgpu-poststop.json`: the poststop hook (removes the per-container state), same condition.

Each hook has an explicit `env` (PATH only: a hook must never inherit the image's env,
CVE-2025-23266) and a `timeout`.  The commands are exactly the ones `containerd install`
puts in the base runtime spec (the sh filter in front of `python -I -S fastpath.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from node_setup import containerd
from node_setup.nodetype.root import Root

DEFAULT_DIR = "/usr/share/containers/oci/hooks.d"
TOKEN_ANNOTATION = "vgpu.k8s.io/allocation-token"
FILES = {"prestart": "vgpu.json", "poststop": "vgpu-poststop.json"}
# hooks.d `when.annotations`: key regex -> value regex (Go RE2, matched unanchored: anchor them).
WHEN = {"^" + TOKEN_ANNOTATION.replace(".", r"\.") + "$": "^[0-9a-f]{32}$"}


def entries(
    python: str, global_args: list[str], timeout: int, state_dir: str | None, hook_path: str | None
) -> dict[str, dict[str, Any]]:
    """{file name: hooks.d 1.0.0 document}."""
    hooks = containerd.hook_entries(python, global_args, timeout, state_dir, hook_path)
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


def _is_ours(text: str | None) -> bool:
    if text is None:
        return False
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and containerd._is_ours(doc.get("hook"))


def plan(args: argparse.Namespace, cfg: Any) -> tuple[Root, dict[str, str]]:
    root = Root(args.root)
    d = os.path.abspath(args.dir or DEFAULT_DIR)
    python = os.path.abspath(args.python or sys.executable)
    if not root.is_host:
        for what, path in (("--python", python), ("--hook-path", args.hook_path or containerd.default_hook_path())):
            if not root.exists(path):
                raise containerd.InstallError(f"{path} does not exist under --root {root.root}: pass {what}")
    state_dir = os.path.abspath(cfg.common.state_dir)
    gargs = containerd.resolved_args(args, cfg)
    docs = entries(python, gargs, args.hook_timeout, None if args.no_shell_filter else state_dir, args.hook_path)
    return root, {os.path.join(d, name): render(doc) for name, doc in docs.items()}


def install(args: argparse.Namespace, cfg: Any) -> int:
    root, files = plan(args, cfg)
    for path, text in files.items():
        old = containerd._read(root, path)
        if old is not None and old != text and not _is_ours(old):
            raise containerd.InstallError(f"{path} exists and is not ours; remove it or choose another --dir")
        if old != text:
            containerd._write(root, path, text, 0o644)
    sys.stdout.write(f"vgpu-hook: hooks.d entries written to {os.path.dirname(next(iter(files)))}\n")
    return 0


def uninstall(args: argparse.Namespace, cfg: Any) -> int:
    root, files = plan(args, cfg)
    removed = 0
    for path in files:
        old = containerd._read(root, path)
        if old is None:
            continue
        if not _is_ours(old):
            sys.stderr.write(f"vgpu-hook: {path} is not ours; left in place\n")
            continue
        containerd._unlink(root, path)
        removed += 1
    sys.stdout.write(f"vgpu-hook: {removed} hooks.d entr{'y' if removed == 1 else 'ies'} removed\n")
    return 0


def show(args: argparse.Namespace, cfg: Any) -> int:
    _, files = plan(args, cfg)
    for path, text in files.items():
        sys.stdout.write(f"# {path}\n{text}")
    return 0


def command(args: argparse.Namespace, cfg: Any) -> int:
    if args.action == "install":
        return install(args, cfg)
    if args.action == "uninstall":
        return uninstall(args, cfg)
    return show(args, cfg)
