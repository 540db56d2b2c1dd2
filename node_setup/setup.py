"""install | uninstall | status of the node's host parts (see node_setup/__init__.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import msgspec

import runtime_hook
from node_setup import files, hookfiles, hostpython
from vgpu import __version__
from vgpu.config import ConfigError, load_config

log = logging.getLogger("vgpu-node-setup")

MANIFEST = "node-setup.json"
LAUNCHER = "bin/vgpu-hook"
LIBRARY_LINK = "lib/libvgpu.so"
HOOK_LINK = "hook/current"
IMAGE_LIBRARY = "/usr/lib/vgpu/libvgpu.so"
_VERSIONED = {"lib": re.compile(r"libvgpu-[0-9a-f]{16}\.so"), "hook": re.compile(r"[0-9a-f]{16}")}
_NOTHING = re.compile(r"(?!)")


class SetupError(Exception):
    """One line for the user; the command exits 1."""


class Options(msgspec.Struct, kw_only=True):
    host_root: str = "/host"
    prefix: str = "/usr/local/vgpu"
    python: str | None = None  # host interpreter for the hook; default: detected
    library_source: str = IMAGE_LIBRARY
    node_config: str = "/etc/vgpu/config.toml"  # host path of the node config (read if present)
    # The hook's state directory; wins over the node config's common.state_dir.  The chart passes
    # its stateDir, the one the device plugin writes allocation records under: a hook looking
    # elsewhere refuses every vGPU container ("unknown vGPU allocation token").
    state_dir: str | None = None
    containerd_config: str = "/etc/containerd/config.toml"  # host path
    handler: str = "vgpu"
    without_nvidia_runtime: bool = False
    containerd_args: list[str] = msgspec.field(default_factory=list)
    restart_containerd: bool = False
    # DRA nodes (docs/developers/dra-plugin.md): the library under the prefix only. The DRA plugin's CDI specs mount
    # it into the containers and give them /etc/ld.so.preload; no hook, no containerd handler, no
    # host python3 needed, containerd's config is never touched.
    library_only: bool = False


class Manifest(msgspec.Struct, kw_only=True):
    """<prefix>/node-setup.json: what install put on the host (read by uninstall and status)."""

    version: str
    python: str = ""  # "" for a library-only install (as are hook, containerd_config and handler)
    python_version: str = ""
    library: str  # current versioned file name under <prefix>/lib
    library_previous: str | None = None
    hook: str = ""  # current version directory under <prefix>/hook
    hook_previous: str | None = None
    created_dirs: list[str] = msgspec.field(default_factory=list)  # host paths
    containerd_config: str = ""
    handler: str = ""
    library_only: bool = False
    # False from the moment install starts placing files until it has finished: an install that
    # was interrupted (a failing step, a kill) still tells uninstall what it made.
    complete: bool = True


def _host(opts: Options, path: str) -> Path:
    """A host path as seen from here (under the host root)."""
    return Path(opts.host_root) / path.lstrip("/")


def _unhost(opts: Options, p: Path) -> str:
    rel = os.path.relpath(p, opts.host_root)
    return "/" + rel if rel != "." else "/"


def _load_manifest(opts: Options) -> Manifest | None:
    path = _host(opts, opts.prefix) / MANIFEST
    try:
        return msgspec.json.decode(path.read_bytes(), type=Manifest)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SetupError(f"{_unhost(opts, path)} is corrupt ({e}); remove it and the prefix to start over") from None


def _write_manifest(prefix: Path, man: Manifest) -> None:
    data = json.dumps(msgspec.to_builtins(man), indent=2, sort_keys=True).encode() + b"\n"
    files.write_if_changed(prefix / MANIFEST, data, 0o644)


def hook_sources() -> tuple[Path, list[str]]:
    root = Path(runtime_hook.__file__).resolve().parents[1]
    try:
        return root, hookfiles.hook_files(root)
    except ValueError as e:
        raise SetupError(str(e)) from None


def launcher_text(python: str, prefix: str) -> str:
    fast = f"{prefix}/{HOOK_LINK}/runtime_hook/fastpath.py"
    return (
        "#!/bin/sh\n"
        "# Written by vgpu-node-setup: the k8s-vgpu OCI hook (prestart|poststop) run by the host's python3.\n"
        f'exec {shlex.quote(python)} -I -S {shlex.quote(fast)} "$@"\n'
    )


def _node_settings(opts: Options) -> list[str]:
    """The hook's flags from the host's node config (defaults when it has none); --state-dir wins."""
    path = _host(opts, opts.node_config)
    try:
        cfg = load_config(str(path) if path.exists() else None)
    except ConfigError as e:
        raise SetupError(f"host {opts.node_config}: {e}") from None
    return [
        "--state-dir", opts.state_dir or cfg.common.state_dir,
        "--log-level", cfg.common.log_level,
        "--library-path", f"{opts.prefix}/{LIBRARY_LINK}",
        "--log-dir", cfg.hook.log_dir,
        "--log-max-bytes", str(cfg.hook.log_max_bytes),
    ]  # fmt: skip


def containerd_argv(opts: Options, action: str, python: str) -> list[str]:
    """`vgpu-hook containerd <action>` against the host root (paths written into configs are host paths)."""
    argv = [sys.executable, "-I", "-m", "node_setup.hookcmd"]
    if action != "uninstall":
        argv += _node_settings(opts)
    argv += ["containerd", action, "--root", opts.host_root, "--containerd-config", opts.containerd_config]
    if action != "uninstall":
        argv += [
            "--handler", opts.handler,
            "--python", python,
            "--hook-path", f"{opts.prefix}/{HOOK_LINK}/runtime_hook/fastpath.py",
        ]  # fmt: skip
        if opts.without_nvidia_runtime:
            argv.append("--without-nvidia-runtime")
        argv += opts.containerd_args
    return argv


def _run_containerd(opts: Options, action: str, python: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "PYTHON"))}
    r = subprocess.run(containerd_argv(opts, action, python), capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0:
        msg = (r.stderr.strip() or r.stdout.strip()).splitlines()
        raise SetupError(msg[-1] if msg else f"vgpu-hook containerd {action} exited {r.returncode}")
    return r.stdout


def _containerd_snapshot(opts: Options, notes: list[str] | None = None) -> dict[str, str]:
    """The host's containerd config directory, file by file (to tell whether a restart is needed).

    Sockets, FIFOs and devices in it are skipped and files that cannot be read are compared by
    size and time (files.tree_state); each such entry adds a line to `notes` when given.
    """
    state, skipped = files.tree_state(_host(opts, os.path.dirname(opts.containerd_config)))
    if notes is not None:
        notes += [f"vgpu-node-setup: note: {_unhost_text(opts, n)}" for n in skipped]
    return state


def _unhost_text(opts: Options, text: str) -> str:
    """A note about host paths, with the host root taken off them."""
    root = os.path.join(os.path.abspath(opts.host_root), "")
    return text.replace(root, "/") if root != "/" else text


def check_default_runtime(opts: Options) -> str | None:
    """What the host's containerd would refuse in the config now on disk, or None.

    Guards the node: containerd's CRI plugin does not load when `default_runtime_name` names no
    runtime (e.g. a config that relied on the built-in `runc` once `runtimes` gets a table), and
    a node without CRI loses every pod.  Checked with the host's own `containerd config dump`
    (chrooted when the host root is not /); skipped when the host has no containerd binary.
    """
    import tomlkit

    root = Path(opts.host_root)
    exe = next((p for p in ("/usr/bin/containerd", "/usr/local/bin/containerd") if _host(opts, p).exists()), None)
    if exe is None:
        return None
    cmd = [exe, "--config", opts.containerd_config, "config", "dump"]
    if root.resolve() != Path("/"):
        cmd = ["chroot", str(root), *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return f"`containerd config dump` fails on the new config: {r.stderr.strip()[-300:]}"
    try:
        doc = tomlkit.parse(r.stdout).unwrap()
    except Exception as e:
        return f"cannot parse `containerd config dump`: {e}"
    plugins = doc.get("plugins", {})
    ctd = (plugins.get("io.containerd.grpc.v1.cri") or plugins.get("io.containerd.cri.v1.runtime") or {}).get(
        "containerd", {}
    )
    default = ctd.get("default_runtime_name") or "runc"
    if default not in (ctd.get("runtimes") or {}):
        return (
            f"the new containerd config has no runtime `{default}` (default_runtime_name): containerd's CRI "
            f"plugin would not load; on this node run `containerd config default > {opts.containerd_config}` "
            "(keeping your settings) and install again"
        )
    return None


def restart_containerd(opts: Options) -> None:
    """The host's `systemctl restart containerd` (as NVIDIA's toolkit container does in its systemd mode).

    From a container, through pid 1's mount namespace (`nsenter -t 1 -m`: the pod has hostPID);
    a plain chroot is not enough, systemctl refuses to act from one.  Running containers survive
    (their shims are not containerd's children); the kubelet's CRI client reconnects.  Without
    systemd on the host there is nothing safe to signal (SIGHUP makes containerd exit): say so.
    """
    root = Path(opts.host_root)
    if not (root / "run/systemd/system").is_dir():
        raise SetupError("--restart-containerd: the host does not run systemd; restart containerd yourself")
    cmd = ["systemctl", "restart", "containerd"]
    if root.resolve() != Path("/"):
        cmd = ["nsenter", "--target", "1", "--mount", "--", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SetupError(f"{' '.join(cmd)} failed: {r.stderr.strip()[:300]}")


def _read_library(opts: Options, old: Manifest | None) -> tuple[bytes, str, str | None]:
    """libvgpu.so's bytes, its versioned name under the prefix, and the previous name to keep."""
    lib_src = Path(opts.library_source)
    try:
        lib_data = lib_src.read_bytes()
    except OSError as e:
        raise SetupError(f"cannot read {lib_src}: {e.strerror}") from None
    lib_name = f"libvgpu-{files.sha256_bytes(lib_data)[:16]}.so"
    prev_lib = old.library if old and old.library != lib_name else (old.library_previous if old else None)
    return lib_data, lib_name, prev_lib


def _put_library(prefix: Path, lib_data: bytes, lib_name: str, prev_lib: str | None) -> list[str]:
    """A versioned file, then the link swap (a process that mapped the old one keeps its inode);
    other versions pruned. Returns what changed."""
    changed: list[str] = []
    if files.write_if_changed(prefix / "lib" / lib_name, lib_data, 0o644):
        changed.append(f"lib/{lib_name}")
    if files.symlink_atomic(prefix / LIBRARY_LINK, lib_name):
        changed.append(LIBRARY_LINK)
    files.prune(prefix / "lib", {lib_name, *([prev_lib] if prev_lib else [])}, "libvgpu-")
    return changed


def _put_hook_tree(prefix: Path, sources: list[tuple[str, bytes]], hook_name: str, prev_hook: str | None) -> list[str]:
    """The hook's Python files: a version directory (made under a temporary name, then renamed
    whole), then the link swap; other versions pruned. Returns what changed."""
    changed: list[str] = []
    hook_dir = prefix / "hook" / hook_name
    if not hook_dir.is_dir():
        tmp = prefix / "hook" / (hook_name + files.TMP_SUFFIX)
        files.remove(tmp)
        for rel, data in sources:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            files.write_if_changed(tmp / rel, data, 0o644)
        for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
            os.chmod(d, 0o755)
        os.rename(tmp, hook_dir)
        changed.append(f"hook/{hook_name}/")
    if files.symlink_atomic(prefix / HOOK_LINK, hook_name):
        changed.append(HOOK_LINK)
    files.prune(prefix / "hook", {hook_name, "current", *([prev_hook] if prev_hook else [])}, "")
    return changed


def install_library_only(opts: Options) -> list[str]:
    """The library under the prefix and nothing else (DRA nodes). Idempotent. Over a full install
    (a node that ran the device plugin before) only the library is renewed: the hook and
    containerd's handler stay until `uninstall`, which removes them as the manifest says."""
    old = _load_manifest(opts)
    if old is not None and not old.library_only:
        lib_data, lib_name, prev_lib = _read_library(opts, old)
        changed = _put_library(_host(opts, opts.prefix), lib_data, lib_name, prev_lib)
        old.library, old.library_previous = lib_name, prev_lib
        _write_manifest(_host(opts, opts.prefix), old)
        return [
            f"vgpu-node-setup: {opts.prefix} on the host: " + (", ".join(changed) if changed else "unchanged"),
            "vgpu-node-setup: the hook and containerd handler of an earlier full install stay (uninstall removes them)",
        ]
    rec = files.Recorder([str(_host(opts, d)) for d in old.created_dirs] if old else None)
    prefix = _host(opts, opts.prefix)
    rec.makedirs(prefix)
    rec.makedirs(prefix / "lib")
    lib_name = old.library if old else ""

    def manifest(complete: bool) -> Manifest:
        return Manifest(
            version=__version__,
            library=lib_name,
            library_previous=prev_lib,
            created_dirs=[_unhost(opts, Path(d)) for d in rec.created],
            library_only=True,
            complete=complete,
        )

    prev_lib = old.library_previous if old else None
    _write_manifest(prefix, manifest(complete=False))  # before the first file (see install)
    lib_data, lib_name, prev_lib = _read_library(opts, old)
    changed = _put_library(prefix, lib_data, lib_name, prev_lib)
    _write_manifest(prefix, manifest(complete=True))
    return [
        f"vgpu-node-setup: {opts.prefix} on the host: " + (", ".join(changed) if changed else "unchanged"),
        "vgpu-node-setup: library only (DRA): no hook, containerd's configuration untouched",
    ]


def install(opts: Options) -> list[str]:
    """Put everything in place; returns the lines to print.  Idempotent."""
    if opts.library_only:
        return install_library_only(opts)
    python, ver = hostpython.find(opts.host_root, opts.python)
    src_root, rels = hook_sources()
    old = _load_manifest(opts)
    lib_data, lib_name, prev_lib = _read_library(opts, old)
    sources = [(rel, (src_root / rel).read_bytes()) for rel in rels]
    hook_name = files.tree_digest(sources)[:16]
    prev_hook = old.hook if old and old.hook and old.hook != hook_name else (old.hook_previous if old else None)
    rec = files.Recorder([str(_host(opts, d)) for d in old.created_dirs] if old else None)
    prefix = _host(opts, opts.prefix)

    def manifest(complete: bool) -> Manifest:
        return Manifest(
            version=__version__,
            python=python,
            python_version=f"{ver[0]}.{ver[1]}",
            library=lib_name,
            library_previous=prev_lib,
            hook=hook_name,
            hook_previous=prev_hook,
            created_dirs=[_unhost(opts, Path(d)) for d in rec.created],
            containerd_config=opts.containerd_config,
            handler=opts.handler,
            complete=complete,
        )

    rec.makedirs(prefix)
    for sub in ("lib", "hook", "bin"):
        rec.makedirs(prefix / sub)
    # Before the first file: what this install is about to make, so that an uninstall after an
    # interruption removes it (and the directories above) too.
    _write_manifest(prefix, manifest(complete=False))
    changed = _put_library(prefix, lib_data, lib_name, prev_lib)

    changed += _put_hook_tree(prefix, sources, hook_name, prev_hook)
    if files.write_if_changed(prefix / LAUNCHER, launcher_text(python, opts.prefix).encode(), 0o755):
        changed.append(LAUNCHER)

    notes: list[str] = []
    before = _containerd_snapshot(opts, notes)
    out = _run_containerd(opts, "install", python)
    problem = check_default_runtime(opts)
    if problem:
        _run_containerd(opts, "uninstall", python)  # leave containerd's config as it was
        raise SetupError(problem)
    containerd_changed = _containerd_snapshot(opts) != before
    _write_manifest(prefix, manifest(complete=True))
    lines = [f"vgpu-node-setup: {opts.prefix} on the host: " + (", ".join(changed) if changed else "unchanged")]
    lines.append(f"vgpu-node-setup: hook runs with the host's {python} (Python {ver[0]}.{ver[1]})")
    lines += [ln for ln in out.splitlines() if ln.strip()]
    lines += notes
    if containerd_changed and opts.restart_containerd:
        restart_containerd(opts)
        lines.append("vgpu-node-setup: containerd restarted")
    elif containerd_changed:
        lines.append("vgpu-node-setup: containerd configuration changed; restart containerd to apply it")
    return lines


def uninstall(opts: Options) -> list[str]:
    """Undo install: containerd's config restored, every file and directory install created removed.
    A library-only install (or, with nothing installed, `--library-only`) never touches containerd."""
    man = _load_manifest(opts)
    lines: list[str] = []
    notes: list[str] = []
    library_only = man.library_only if man is not None else opts.library_only
    before = {} if library_only else _containerd_snapshot(opts, notes)
    if not library_only:
        out = _run_containerd(opts, "uninstall", (man.python if man else "") or "/usr/bin/python3")
        lines += [ln for ln in out.splitlines() if ln.strip()]
    prefix = _host(opts, opts.prefix)
    if man is None:
        lines.append(f"vgpu-node-setup: nothing installed under {opts.prefix}")
    else:
        for rel in (LAUNCHER, HOOK_LINK, LIBRARY_LINK):
            files.remove(prefix / rel)
        for name in (man.hook, man.hook_previous):
            if name:
                files.remove(prefix / "hook" / name)
        for name in (man.library, man.library_previous):
            if name:
                files.remove(prefix / "lib" / name)
        # What an install killed half-way leaves: temporary files, and versions it had not
        # pruned yet (only our own names: libvgpu-<hex>.so, hook/<16 hex>/).
        for sub in ("", "lib", "hook", "bin"):
            sd = prefix / sub
            if sd.is_dir() and not sd.is_symlink():
                for entry in sd.iterdir():
                    if files.is_temporary(entry.name) or _VERSIONED.get(sub, _NOTHING).fullmatch(entry.name):
                        files.remove(entry)
        files.remove(prefix / MANIFEST)
        for d in reversed(man.created_dirs):
            p = _host(opts, d)
            try:
                p.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                lines.append(f"vgpu-node-setup: left {_unhost(opts, p)} (not empty)")
        lines.append(f"vgpu-node-setup: removed {opts.prefix} from the host")
    if not library_only and _containerd_snapshot(opts) != before:
        if opts.restart_containerd:
            restart_containerd(opts)
            lines.append("vgpu-node-setup: containerd restarted")
        else:
            lines.append("vgpu-node-setup: containerd configuration restored; restart containerd to apply it")
    return lines + notes


def status(opts: Options) -> tuple[int, dict[str, object]]:
    """(exit code, report): 0 when installed and intact, 1 otherwise."""
    man = _load_manifest(opts)
    if man is None:
        return 1, {"installed": False, "prefix": opts.prefix}
    prefix = _host(opts, opts.prefix)
    problems = []
    if not man.complete:
        problems.append("the last install did not finish: run install again (or uninstall)")
    wanted = (LIBRARY_LINK,) if man.library_only else (LAUNCHER, LIBRARY_LINK, f"{HOOK_LINK}/runtime_hook/fastpath.py")
    for rel in wanted:
        if not (prefix / rel).exists():
            problems.append(f"{opts.prefix}/{rel} missing")
    if not man.library_only:
        python = _host(opts, man.python)
        if not python.exists():
            problems.append(f"host {man.python} missing")
        side = _host(opts, opts.containerd_config + ".vgpu-hook.json")
        if not side.exists():
            problems.append(f"containerd not wired ({opts.containerd_config}.vgpu-hook.json missing)")
    report: dict[str, object] = {
        "installed": True,
        "prefix": opts.prefix,
        "version": man.version,
        "library_only": man.library_only,
        "library": man.library,
        "problems": problems,
    }
    if not man.library_only:
        report["python"] = f"{man.python} ({man.python_version})"
        report["hook"] = man.hook
    return (1 if problems else 0), report
