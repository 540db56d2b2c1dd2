"""Which Python files the installed hook needs, found by following its imports.

The hook runs on the host with the host's python3 and nothing else, so the files copied there
must import only the standard library and each other.  `closure()` starts at
runtime_hook/fastpath.py and follows every import (module level and inside functions) of our
own packages, except the edges into modules that only the installer commands use
(`INSTALLER_ONLY`: reached from `vgpu-hook containerd ...`, never from prestart/poststop with
the flags `containerd install` writes).  `audit()` reports every import of a module outside the
standard library and outside the closure.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

OUR_PACKAGES = ("runtime_hook", "vgpu")
ENTRY = "runtime_hook.fastpath"
# Imported only when the hook is started without the full set of flags and a config file exists
# (runtime_hook.settings.load_config: vgpu.config, msgspec and a TOML parser from site-packages):
# never on the paths the installed hook runs.
INSTALLER_ONLY = frozenset({"vgpu.config"})
# `site` is among them: runtime_hook.settings.enable_site_packages imports it to read a node config.
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")
    pkg = root.joinpath(*parts, "__init__.py")
    if pkg.exists():
        return pkg
    mod = root.joinpath(*parts[:-1], parts[-1] + ".py")
    return mod if mod.exists() else None


def _imports(path: Path, module: str) -> set[str]:
    """Absolute names of every module imported anywhere in the file (`from p import m` gives p.m when m is a module)."""
    tree = ast.parse(path.read_bytes(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            out.add(prefix)
            out.update(f"{prefix}.{a.name}" for a in node.names)
    return out


def _ours(name: str) -> bool:
    return name.split(".")[0] in OUR_PACKAGES


def closure(root: Path) -> dict[str, Path]:
    """module name -> source file, for every module of ours the hook can import."""
    found: dict[str, Path] = {}
    todo = [ENTRY]
    while todo:
        mod = todo.pop()
        if mod in found or mod in INSTALLER_ONLY:
            continue
        path = _module_file(root, mod)
        if path is None:
            continue  # `from pkg import name` where name is not a module
        found[mod] = path
        parts = mod.split(".")
        for i in range(1, len(parts)):  # importing a.b.c imports a and a.b first
            todo.append(".".join(parts[:i]))
        todo.extend(n for n in _imports(path, mod) if _ours(n))
    return found


def audit(root: Path, modules: dict[str, Path]) -> list[str]:
    """Problems: imports of modules that are neither standard library nor in `modules`."""
    problems = []
    for mod, path in sorted(modules.items()):
        for name in sorted(_imports(path, mod)):
            top = name.split(".")[0]
            if _ours(name):
                if name in INSTALLER_ONLY or name in modules or _module_file(root, name) is None:
                    continue
                problems.append(f"{mod} imports {name}, which is not copied")
            elif top not in STDLIB:
                problems.append(f"{mod} imports {name}, which is not in the standard library")
    return problems


def hook_files(root: Path) -> list[str]:
    """Relative paths (posix) of the files to copy, sorted; raises ValueError if the audit fails."""
    modules = closure(root)
    problems = audit(root, modules)
    if problems:
        raise ValueError("the hook is not standard-library only: " + "; ".join(problems))
    return sorted(p.relative_to(root).as_posix() for p in modules.values())
