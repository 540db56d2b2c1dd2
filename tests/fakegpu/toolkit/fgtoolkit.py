"""The simulated NVIDIA container toolkit: the logic shared by its programs.

`nvidia-container-runtime` (+ `.legacy`, `.cdi`), `nvidia-container-runtime-hook` and
`fakegpu-cdi` (this directory; `make` installs them into build/fakegpu/) import this module from
their own directory.  Standard library only, Python >= 3.11 (tomllib): they run under
containerd-shim's environment, with the system python3 and no venv.

What the real toolkit does, with citations, and what this stand-in leaves out: docs/fakegpu.md
"The simulated container toolkit" and /work/shared/reference/gpu-injection.md §2.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import stat
import sys
from typing import Any

import tomllib

VOLUME_ROOT = "/var/run/nvidia-container-devices"
NVIDIA_HOOKS = ("nvidia-container-runtime-hook", "nvidia-container-toolkit")
DRIVER_ENV = "/etc/fakegpu/driver.env"  # read by the fakegpu libraries (src/fg_visible.c)
CONTAINER_STATE = "/var/lib/fakegpu/fakegpu.state"
CONTAINER_CONFIG = "/var/lib/fakegpu/fakegpu.conf"
DEFAULT_KIND = "nvidia.com/gpu"
DEFAULT_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
HERE = os.path.dirname(os.path.realpath(__file__))
# A CDI name: vendor/class=device (cncf-tags/container-device-interface pkg/parser).
_QUALIFIED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9_.-]*=[A-Za-z0-9][A-Za-z0-9_.:-]*$")


class ToolkitError(Exception):
    """One line for the user (stderr and the runtime's --log file)."""


# ---- configuration ------------------------------------------------------------------------


def config_file(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """NVIDIA_CTK_CONFIG_FILE_PATH, else $XDG_CONFIG_HOME/nvidia-container-runtime/config.toml,
    else /etc/nvidia-container-runtime/config.toml (api/config/v1/config.go@v1.20.0)."""
    if env.get("NVIDIA_CTK_CONFIG_FILE_PATH"):
        return env["NVIDIA_CTK_CONFIG_FILE_PATH"]
    if env.get("XDG_CONFIG_HOME"):
        return os.path.join(env["XDG_CONFIG_HOME"], "nvidia-container-runtime", "config.toml")
    return "/etc/nvidia-container-runtime/config.toml"


def load_config(path: str | None = None) -> dict[str, Any]:
    """The toolkit config with NVIDIA's defaults filled in (a missing file: all defaults)."""
    path = path or config_file()
    raw: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        pass
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ToolkitError(f"config {path}: {e}") from None
    rt = raw.get("nvidia-container-runtime", {})
    cdi = rt.get("modes", {}).get("cdi", {})
    hook = raw.get("nvidia-container-runtime-hook", {})
    fg = raw.get("fakegpu", {})
    return {
        "path": path,
        "accept_envvar_unprivileged": bool(raw.get("accept-nvidia-visible-devices-envvar-when-unprivileged", True)),
        "accept_volume_mounts": bool(raw.get("accept-nvidia-visible-devices-as-volume-mounts", False)),
        "mode": str(rt.get("mode", "auto")),
        "runtimes": list(rt.get("runtimes", ["runc", "crun"])),
        "log_level": str(rt.get("log-level", "info")),
        "default_kind": str(cdi.get("default-kind", DEFAULT_KIND)),
        "annotation_prefixes": list(cdi.get("annotation-prefixes", ["cdi.k8s.io/"])),
        "spec_dirs": list(cdi.get("spec-dirs", ["/etc/cdi", "/var/run/cdi"])),
        "hook_path": str(hook.get("path", "") or os.path.join(HERE, "nvidia-container-runtime-hook")),
        "fakegpu": {
            "config": str(fg.get("config", "")),
            "state": str(fg.get("state", "/tmp/fakegpu.state")),
            "lib_dir": str(fg.get("lib-dir", HERE)),
            "container_lib_dir": str(fg.get("container-lib-dir", DEFAULT_LIB_DIR)),
        },
    }


# ---- the simulated GPUs -----------------------------------------------------------------------


def fakegpu_devices(config_path: str) -> list[dict[str, Any]]:
    """index, uuid, minor of each device of a fakegpu config file (src/fg_config.c's rules:
    no [device] section means `gpus` default devices, unset keys take the index's defaults)."""

    def default(i: int) -> dict[str, Any]:
        return {"index": i, "uuid": f"GPU-fa6e0000-0000-4000-8000-{0x100 + i:012x}", "minor": i}

    if not config_path:
        return [default(0), default(1)]
    try:
        with open(config_path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ToolkitError(f"fakegpu config {config_path}: {e.strerror}") from None
    gpus = 2
    devs: list[dict[str, Any]] = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line == "[device]":
            devs.append(default(len(devs)))
            continue
        key, _, value = (p.strip() for p in line.partition("="))
        if not devs and key == "gpus":
            gpus = int(value)
        elif devs and key == "uuid":
            devs[-1]["uuid"] = value
        elif devs and key == "minor_number":
            devs[-1]["minor"] = int(value, 0)
    return devs or [default(i) for i in range(gpus)]


def _node(path: str) -> dict[str, Any]:
    # The stand-in device node: /dev/null's numbers under NVIDIA's name.  The simulated libraries
    # see the GPUs whose /dev/nvidia<minor> exists (FAKEGPU_VISIBLE_DEVICES=/dev), as the real
    # driver sees only the device nodes the container was given.
    return {"path": path, "hostPath": "/dev/null"}


def generate_spec(fg: dict[str, Any], kind: str = DEFAULT_KIND) -> dict[str, Any]:
    """The CDI spec of the simulated GPUs: one device per UUID and per index, plus `all`; the
    common edits mount the driver libraries and the state, set the driver's env and
    NVIDIA_VISIBLE_DEVICES=void as NVIDIA's generated specs do (pkg/nvcdi/wrapper.go@v1.20.0:99)."""
    gpus = fakegpu_devices(fg["config"])
    lib_dir = fg["container_lib_dir"].rstrip("/")
    mounts = [
        {
            "hostPath": os.path.join(fg["lib_dir"], lib),
            "containerPath": f"{lib_dir}/{lib}",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }
        for lib in LIBS
    ]
    env = ["NVIDIA_VISIBLE_DEVICES=void", f"FAKEGPU_STATE={CONTAINER_STATE}", "FAKEGPU_VISIBLE_DEVICES=/dev"]
    mounts.append(
        {"hostPath": fg["state"], "containerPath": CONTAINER_STATE, "options": ["rw", "nosuid", "nodev", "bind"]}
    )
    if fg["config"]:
        mounts.append(
            {"hostPath": fg["config"], "containerPath": CONTAINER_CONFIG, "options": ["ro", "nosuid", "nodev", "bind"]}
        )
        env.append(f"FAKEGPU_CONFIG={CONTAINER_CONFIG}")
    devices = []
    for g in gpus:
        edits = {"deviceNodes": [_node(f"/dev/nvidia{g['minor']}")]}
        devices.append({"name": g["uuid"], "containerEdits": edits})
        devices.append({"name": str(g["index"]), "containerEdits": edits})
    devices.append(
        {"name": "all", "containerEdits": {"deviceNodes": [_node(f"/dev/nvidia{g['minor']}") for g in gpus]}}
    )
    return {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": devices,
        "containerEdits": {"env": env, "deviceNodes": [_node("/dev/nvidiactl")], "mounts": mounts},
    }


# ---- which devices a container asks for (internal/config/image/cuda_image.go@v1.20.0) ---------


def _env(spec: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (spec.get("process") or {}).get("env") or []:
        k, sep, v = str(item).partition("=")
        if sep:
            out[k] = v  # the last one wins, as in the container's environ
    return out


def privileged(spec: dict[str, Any]) -> bool:
    caps = ((spec.get("process") or {}).get("capabilities") or {}).get("bounding") or []
    return "CAP_SYS_ADMIN" in caps


def from_annotations(spec: dict[str, Any], prefixes: list[str]) -> list[str]:
    out: list[str] = []
    for key, value in sorted((spec.get("annotations") or {}).items()):
        if any(key.startswith(p) for p in prefixes):
            out += [v.strip() for v in str(value).split(",") if v.strip()]
    return out


def from_mounts(spec: dict[str, Any]) -> list[str]:
    out = []
    for m in spec.get("mounts") or []:
        dst = str(m.get("destination", ""))
        if m.get("source") != "/dev/null" or not dst.startswith(VOLUME_ROOT + "/"):
            continue
        rest = dst[len(VOLUME_ROOT) + 1 :]
        if rest.startswith("cdi/"):  # cdi/<vendor>/<class>/<dev> or cdi/<vendor>/<class>=<dev>
            parts = rest[4:].split("/")
            rest = "/".join(parts[:2]) + "=" + parts[2] if len(parts) == 3 else rest[4:]
        out.append(rest)
    return out


def from_env(spec: dict[str, Any]) -> list[str] | None:
    env = _env(spec)
    value = env.get("NVIDIA_VISIBLE_DEVICES")
    if value is None:
        # A "legacy" CUDA image (CUDA_VERSION without NVIDIA_REQUIRE_CUDA) defaults to all.
        return ["all"] if "CUDA_VERSION" in env and "NVIDIA_REQUIRE_CUDA" not in env else None
    if value in ("", "void"):
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def requested(spec: dict[str, Any], cfg: dict[str, Any], *, annotations: bool) -> list[str]:
    """The device requests, in the real runtime's order: CDI annotations (cdi mode only), then
    /dev/null volume mounts (if accepted), then NVIDIA_VISIBLE_DEVICES (privileged, or if
    accepted for unprivileged containers)."""
    if annotations:
        got = from_annotations(spec, cfg["annotation_prefixes"])
        if got:
            return got
    if cfg["accept_volume_mounts"]:
        got = from_mounts(spec)
        if got:
            return got
    env = from_env(spec) or []
    if env and not (privileged(spec) or cfg["accept_envvar_unprivileged"]):
        log(cfg, "warning: ignoring devices in NVIDIA_VISIBLE_DEVICES in an unprivileged container")
        return []
    return env


def qualified(name: str) -> bool:
    return bool(_QUALIFIED.match(name))


def resolve_mode(spec: dict[str, Any], cfg: dict[str, Any], forced: str | None) -> str:
    """legacy or cdi.  `auto` is cdi when every request is a fully qualified CDI name, else legacy:
    the <=1.17 behaviour (internal/info/auto.go@v1.17.9); from 1.18 NVIDIA's auto means jit-cdi
    (an in-memory spec from the host driver), which this stand-in does not model."""
    mode = forced or cfg["mode"]
    if mode == "auto":
        devs = requested(spec, cfg, annotations=True)
        return "cdi" if devs and all(qualified(d) for d in devs) else "legacy"
    if mode not in ("legacy", "cdi"):
        raise ToolkitError(f"unsupported mode {mode!r} (the stand-in knows auto, legacy, cdi)")
    return mode


_logged: set[str] = set()


def log(cfg: dict[str, Any], msg: str) -> None:
    if (cfg.get("log_level") == "debug" or msg.startswith("warning")) and msg not in _logged:
        _logged.add(msg)
        print(f"nvidia-container-runtime: {msg}", file=sys.stderr)


# ---- CDI ------------------------------------------------------------------------------------


def load_specs(dirs: list[str]) -> dict[str, dict[str, Any]]:
    """name -> (spec, device) for every device of the JSON specs in dirs (a later dir wins).
    YAML specs are not read (stdlib only)."""
    out: dict[str, Any] = {}
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for n in names:
            if not n.endswith(".json"):
                continue
            try:
                with open(os.path.join(d, n)) as f:
                    spec = json.load(f)
            except (OSError, ValueError) as e:
                raise ToolkitError(f"CDI spec {os.path.join(d, n)}: {e}") from None
            for dev in spec.get("devices") or []:
                out[f"{spec['kind']}={dev['name']}"] = {"spec": spec, "device": dev}
    return out


def _sort_key(m: dict[str, Any]) -> int:
    return len([p for p in str(m.get("destination", "")).split("/") if p])


def apply_edits(spec: dict[str, Any], edits: dict[str, Any]) -> None:
    """CDI containerEdits into an OCI spec (pkg/cdi/container-edits.go@v1.1.0:72-170): env
    replaces a key or is appended, device nodes go to linux.devices with an allow rule, mounts
    are appended and sorted by depth, hooks are appended to their phase."""
    proc = spec.get("process") or {}
    spec["process"] = proc
    env = list(proc.get("env") or [])
    for item in edits.get("env") or []:
        key = item.split("=", 1)[0]
        env = [e for e in env if e.split("=", 1)[0] != key] + [item]
    proc["env"] = env
    linux = spec.get("linux") or {}
    spec["linux"] = linux
    for dn in edits.get("deviceNodes") or []:
        host = dn.get("hostPath") or dn["path"]
        st = os.stat(host)
        kind = dn.get("type") or ("b" if stat.S_ISBLK(st.st_mode) else "c")
        major = dn.get("major", os.major(st.st_rdev))
        minor = dn.get("minor", os.minor(st.st_rdev))
        devs = [d for d in linux.get("devices") or [] if d.get("path") != dn["path"]]
        node = {"path": dn["path"], "type": kind, "major": major, "minor": minor, "fileMode": dn.get("fileMode", 0o666)}
        node.update({"uid": dn.get("uid", 0), "gid": dn.get("gid", 0)})
        linux["devices"] = [*devs, node]
        rules = linux.setdefault("resources", {}).setdefault("devices", [])
        rules.append(
            {"allow": True, "type": kind, "major": major, "minor": minor, "access": dn.get("permissions", "rwm")}
        )
    if edits.get("mounts"):
        mounts = list(spec.get("mounts") or [])
        for m in edits["mounts"]:
            mounts.append(
                {
                    "destination": m["containerPath"],
                    "type": m.get("type", "bind"),
                    "source": m["hostPath"],
                    "options": list(m.get("options") or []),
                }
            )
        spec["mounts"] = sorted(mounts, key=_sort_key)  # stable: equal depths keep their order
    for h in edits.get("hooks") or []:
        entry = {k: v for k, v in h.items() if k in ("path", "args", "env", "timeout")}
        spec.setdefault("hooks", {}).setdefault(h["hookName"], []).append(entry)


def inject_cdi(spec: dict[str, Any], names: list[str], cfg: dict[str, Any]) -> list[str]:
    """Applies the CDI devices `names` (unqualified -> <default-kind>=<name>); raises
    `unresolvable CDI devices ...` (the CDI library's message) for unknown ones."""
    wanted = [n if qualified(n) else f"{cfg['default_kind']}={n}" for n in names]
    if not wanted:
        return []
    known = load_specs(cfg["spec_dirs"])
    missing = [n for n in wanted if n not in known]
    if missing:
        raise ToolkitError(f"unresolvable CDI devices {', '.join(missing)}")
    seen: list[int] = []
    for n in dict.fromkeys(wanted):
        s = known[n]["spec"]
        if id(s) not in seen:  # spec-level edits once per spec
            seen.append(id(s))
            apply_edits(spec, s.get("containerEdits") or {})
        apply_edits(spec, known[n]["device"].get("containerEdits") or {})
    return wanted


def modify(spec: dict[str, Any], cfg: dict[str, Any], forced: str | None = None) -> str:
    """What the runtime does to config.json on `create`; returns the mode used."""
    mode = resolve_mode(spec, cfg, forced)
    hooks = spec.get("hooks") or {}
    spec["hooks"] = hooks
    pre = list(hooks.get("prestart") or [])
    if mode == "legacy":
        # stable.go:66: appended at the END (our base_runtime_spec hooks run first), once.
        if not any(os.path.basename(str(h.get("path", ""))) == NVIDIA_HOOKS[0] for h in pre):
            pre.append({"path": cfg["hook_path"], "args": [NVIDIA_HOOKS[0], "prestart"]})
        hooks["prestart"] = pre
        return mode
    hooks["prestart"] = [h for h in pre if os.path.basename(str(h.get("path", ""))) not in NVIDIA_HOOKS]
    if not hooks["prestart"]:
        del hooks["prestart"]
    names = requested(spec, cfg, annotations=True)
    names = [n for n in names if n not in ("none", "void")]
    inject_cdi(spec, names, cfg)
    return mode


# ---- the runtime's argv (internal/oci/args.go) -----------------------------------------------


def has_create(args: list[str]) -> bool:
    prev_bundle = False
    for a in args:
        if not prev_bundle and a in ("-b", "--bundle"):
            prev_bundle = True
            continue
        if not prev_bundle and a == "create":
            return True
        prev_bundle = False
    return False


def bundle_dir(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a in ("-b", "--bundle") and i + 1 < len(args):
            return args[i + 1]
        for p in ("-b=", "--bundle="):
            if a.startswith(p):
                return a[len(p) :]
    return os.getcwd()


def log_file(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        if a == "--log" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--log="):
            return a[len("--log=") :]
    return None


def low_level_runtime(cfg: dict[str, Any]) -> str:
    for name in cfg["runtimes"]:
        if os.path.isabs(name) and os.access(name, os.X_OK):
            return str(name)
        for d in os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
            p = os.path.join(d or ".", name)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    raise ToolkitError(f"no low-level runtime found: {', '.join(cfg['runtimes'])}")


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.nvct-{os.getpid()}"
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o644
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def report_error(args: list[str], msg: str) -> None:
    """stderr, and runc's --log file in its JSON format, where containerd reads the last error."""
    print(f"nvidia-container-runtime: {msg}", file=sys.stderr)
    path = log_file(args)
    if path:
        import datetime

        line = {"level": "error", "msg": msg, "time": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        try:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass


def runtime_main(argv: list[str], forced: str | None = None) -> int:
    args = argv[1:]
    try:
        cfg = load_config()
        if has_create(args):
            path = os.path.join(bundle_dir(args), "config.json")
            try:
                with open(path) as f:
                    spec = json.load(f)
            except (OSError, ValueError) as e:
                raise ToolkitError(f"{path}: {e}") from None
            mode = modify(spec, cfg, forced)
            write_json_atomic(path, spec)
            log(cfg, f"create: mode {mode}, {path} updated")
        runtime = low_level_runtime(cfg)
    except ToolkitError as e:
        report_error(args, f"error: {e}")
        return 1
    os.execv(runtime, [runtime, *args])
    return 127  # not reached


# ---- the legacy hook ---------------------------------------------------------------------------

_libc = None


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
CLONE_NEWNS = 0x00020000


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise ToolkitError(f"{what}: {os.strerror(e)}")


def in_rootfs(rootfs: str, path: str) -> str:
    """`path` resolved inside rootfs, symlinks followed as the container would (absolute ones
    from rootfs): never a host path outside it (an image can plant symlinks)."""
    parts = [p for p in path.split("/") if p and p != "."]
    cur = rootfs
    hops = 0
    while parts:
        p = parts.pop(0)
        if p == "..":
            cur = os.path.dirname(cur) if cur != rootfs else rootfs
            continue
        nxt = os.path.join(cur, p)
        if os.path.islink(nxt):
            hops += 1
            if hops > 40:
                raise ToolkitError(f"{path}: too many symlinks in the rootfs")
            target = os.readlink(nxt)
            parts = [q for q in target.split("/") if q and q != "."] + parts
            if target.startswith("/"):
                cur = rootfs
            continue
        cur = nxt
    return cur


def _mount_file(src: str, dst: str, ro: bool) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if not os.path.exists(dst):
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    _check(_c().mount(src.encode(), dst.encode(), None, MS_BIND, None), f"mount {src} on {dst}")
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (MS_RDONLY if ro else 0)
    _check(_c().mount(None, dst.encode(), None, flags, None), f"remount {dst}")


def legacy_edits(names: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """The same edits as the CDI spec (one source of truth) for the legacy device names: indexes,
    UUIDs, `all`, `none` (driver only)."""
    state = cfg["fakegpu"]["state"]
    if not os.path.isfile(state):
        raise ToolkitError(f"fakegpu state {state} does not exist (set [fakegpu] state in {cfg['path']})")
    spec = generate_spec(cfg["fakegpu"])
    by_name = {d["name"]: d for d in spec["devices"]}
    nodes: list[dict[str, Any]] = []
    for n in names:
        if n == "none":
            continue
        if n not in by_name:
            raise ToolkitError(f"device error: {n}: unknown device")
        nodes += by_name[n]["containerEdits"]["deviceNodes"]
    edits = dict(spec["containerEdits"])
    edits["deviceNodes"] = list(edits["deviceNodes"]) + nodes
    return edits


def hook_main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "prestart":
        return 0  # poststart/poststop: nothing to do
    try:
        state = json.loads(sys.stdin.read())
        bundle, pid = str(state["bundle"]), int(state["pid"])
        cfg = load_config()
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
        names = requested(spec, cfg, annotations=False)
        if not names:
            return 0
        edits = legacy_edits(names, cfg)
        root = (spec.get("root") or {}).get("path", "rootfs")
        rootfs = os.path.realpath(os.path.join(bundle, root))
        # Env cannot be changed by a hook: the libraries read it from a file (DRIVER_ENV).
        env_file = os.path.join(bundle, "fakegpu-driver.env")
        with open(env_file, "w") as f:
            f.write("".join(e + "\n" for e in edits["env"] if e.startswith("FAKEGPU_")))
        nodes = []
        for dn in edits["deviceNodes"]:
            st = os.stat(dn.get("hostPath") or dn["path"])
            nodes.append((dn["path"], st.st_mode & 0o170000, st.st_rdev))
        # Into the container's mount namespace (before pivot_root the rootfs is at its host
        # path there), as nvidia-container-cli --pid does: mounts stay the container's own.
        fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
        _check(_c().setns(fd, CLONE_NEWNS), "setns")
        os.close(fd)
        for m in edits["mounts"]:
            _mount_file(m["hostPath"], in_rootfs(rootfs, m["containerPath"]), "ro" in m.get("options", []))
        _mount_file(env_file, in_rootfs(rootfs, DRIVER_ENV), True)
        for path, kind, rdev in nodes:
            dst = in_rootfs(rootfs, path)
            if not os.path.exists(dst):
                os.mknod(dst, kind | 0o666, rdev)
                os.chmod(dst, 0o666)
    except ToolkitError as e:
        print(f"nvidia-container-cli: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError) as e:
        print(f"nvidia-container-runtime-hook: {e}", file=sys.stderr)
        return 1
    return 0


# ---- fakegpu-cdi ------------------------------------------------------------------------------


def cdi_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="fakegpu-cdi", description="CDI spec (JSON) for the simulated GPUs")
    ap.add_argument("--toolkit-config", help="take the [fakegpu] section of this toolkit config")
    ap.add_argument("--config", help="fakegpu device config (FAKEGPU_CONFIG)")
    ap.add_argument("--state", help="fakegpu state file (FAKEGPU_STATE)")
    ap.add_argument("--lib-dir", help="host directory of libcuda.so.1 / libnvidia-ml.so.1")
    ap.add_argument("--container-lib-dir", help=f"where they appear in the container (default {DEFAULT_LIB_DIR})")
    ap.add_argument("--kind", default=DEFAULT_KIND)
    ap.add_argument("--output", "-o", help="file to write (default: stdout)")
    a = ap.parse_args(argv[1:])
    try:
        fg = load_config(a.toolkit_config or "/nonexistent/config.toml")["fakegpu"]
        for key in ("config", "state", "lib_dir", "container_lib_dir"):
            if getattr(a, key):
                fg[key] = os.path.abspath(getattr(a, key)) if key != "container_lib_dir" else getattr(a, key)
        spec = generate_spec(fg, a.kind)
    except ToolkitError as e:
        print(f"fakegpu-cdi: {e}", file=sys.stderr)
        return 1
    if a.output:
        os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
        write_json_atomic(a.output, spec)
    else:
        print(json.dumps(spec, indent=1))
    return 0
