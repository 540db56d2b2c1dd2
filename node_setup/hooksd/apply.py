"""The hooks.d entries written, removed or shown; each returns the lines the command prints."""

from __future__ import annotations

from node_setup import hostfiles
from node_setup.hooksd.plan import Options, files, is_our_entry
from node_setup.hookspec import missing_on_host
from node_setup.hostfiles import InstallError
from node_setup.nodetype.root import Root


def _planned(opts: Options) -> tuple[Root, dict[str, str]]:
    root = Root(opts.root)
    if not root.is_host:
        missing = missing_on_host(opts.hook, root.exists, root.root)
        if missing:
            raise InstallError(missing)
    return root, files(opts)


def install(opts: Options) -> list[str]:
    """Every entry written unless it already holds what we write; a file of someone else's under
    our name is an error, never overwritten."""
    root, planned = _planned(opts)
    for path, text in planned.items():
        old = hostfiles.read(root, path)
        if old is not None and old != text and not is_our_entry(old):
            raise InstallError(f"{path} exists and is not ours; remove it or choose another --dir")
        if old != text:
            hostfiles.write(root, path, text, 0o644)
    return [f"vgpu-hook: hooks.d entries written to {opts.directory}"]


def uninstall(opts: Options) -> tuple[list[str], list[str]]:
    """Our entries removed, anyone else's left: (lines for stdout, warnings for stderr)."""
    root, planned = _planned(opts)
    removed = 0
    warnings = []
    for path in planned:
        old = hostfiles.read(root, path)
        if old is None:
            continue
        if not is_our_entry(old):
            warnings.append(f"vgpu-hook: {path} is not ours; left in place")
            continue
        hostfiles.unlink(root, path)
        removed += 1
    return [f"vgpu-hook: {removed} hooks.d entr{'y' if removed == 1 else 'ies'} removed"], warnings


def show(opts: Options) -> str:
    _, planned = _planned(opts)
    return "".join(f"# {path}\n{text}" for path, text in planned.items())
