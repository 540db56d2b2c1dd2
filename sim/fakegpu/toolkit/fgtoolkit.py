"""The simulated NVIDIA container toolkit: the logic shared by its programs.

`nvidia-container-runtime` (+ `.legacy`, `.cdi`), `nvidia-container-runtime-hook` and
`fakegpu-cdi` (this directory; `make` installs them into build/fakegpu/) import this module from
their own directory.  Standard library only (PyYAML, Debian's python3-yaml, for YAML CDI specs),
Python >= 3.11 (tomllib): they run under containerd-shim's environment, with the system python3
and no venv.

A model of NVIDIA Container Toolkit 1.20.0 (commit d34b3046), written from its source; each
behaviour cites the file/function it models (paths are the toolkit repository's; `cdi/...` is the
vendored tags.cncf.io/container-device-interface v1.1.0, `runtime-tools/...` the vendored
opencontainers/runtime-tools).  Checked against the recorded real runs in
tests/data/real-traces/nvidia-toolkit/runtime-edit (tests/sim/test_toolkit.py replays them).
What this stand-in leaves out: docs/developers/simulators.md "The simulated container toolkit".
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import stat
import sys
from typing import Any

import tomllib

VOLUME_ROOT = "/var/run/nvidia-container-devices"  # image.DeviceListAsVolumeMountsRoot
NVIDIA_HOOKS = ("nvidia-container-runtime-hook", "nvidia-container-toolkit")
DRIVER_ENV = "/etc/fakegpu/driver.env"  # read by the fakegpu libraries (src/fg_visible.c)
CONTAINER_STATE = "/var/lib/fakegpu/fakegpu.state"
CONTAINER_CONFIG = "/var/lib/fakegpu/fakegpu.conf"
DEFAULT_KIND = "nvidia.com/gpu"
JIT_KIND = "runtime.nvidia.com/gpu"  # internal/modifier/cdi.go: automaticDeviceKind
DEFAULT_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
HERE = os.path.dirname(os.path.realpath(__file__))
MODES = ("legacy", "csv", "jit-cdi", "cdi")  # internal/modifier/factory.go: validate
LEVELS = {"trace": 0, "debug": 1, "info": 2, "warning": 3, "error": 4}
# cmd/nvidia-container-runtime-hook/hook_config.go: assertModeIsLegacy
HOOK_MODE_ERROR = (
    "invoking the NVIDIA Container Runtime Hook directly (e.g. specifying the docker --gpus flag) is not "
    "supported. Please use the NVIDIA Container Runtime (e.g. specify the --runtime=nvidia flag) instead"
)


class ToolkitError(Exception):
    """The error the program logs at level error (and exits 1 with)."""


# ---- configuration (api/config/v1/config.go, runtime.go, hook.go) --------------------------


def config_file(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """NVIDIA_CTK_CONFIG_FILE_PATH, else $XDG_CONFIG_HOME/nvidia-container-runtime/config.toml,
    else /etc/nvidia-container-runtime/config.toml (config.go: GetConfigFilePath)."""
    if env.get("NVIDIA_CTK_CONFIG_FILE_PATH"):
        return env["NVIDIA_CTK_CONFIG_FILE_PATH"]
    if env.get("XDG_CONFIG_HOME"):
        return os.path.join(env["XDG_CONFIG_HOME"], "nvidia-container-runtime", "config.toml")
    return "/etc/nvidia-container-runtime/config.toml"


def _list(v: Any, default: list[str]) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else default


def load_config(path: str | None = None) -> dict[str, Any]:
    """The toolkit config with NVIDIA's defaults filled in (a missing file: all defaults,
    config.go: GetDefault)."""
    path = path or config_file()
    raw: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        pass
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ToolkitError(f"error loading config: {path}: {e}") from None
    rt = raw.get("nvidia-container-runtime", {})
    cdi = rt.get("modes", {}).get("cdi", {})
    hook = raw.get("nvidia-container-runtime-hook", {})
    fg = raw.get("fakegpu", {})
    return {
        "path": path,
        "accept_envvar_unprivileged": bool(raw.get("accept-nvidia-visible-devices-envvar-when-unprivileged", True)),
        "accept_volume_mounts": bool(raw.get("accept-nvidia-visible-devices-as-volume-mounts", False)),
        "swarm_resource": str(raw.get("swarm-resource", "")),
        "mode": str(rt.get("mode", "auto")),
        "runtimes": _list(rt.get("runtimes"), ["runc", "crun"]),
        "log_level": str(rt.get("log-level", "info")),
        "debug": str(rt.get("debug", "")),
        "default_kind": str(cdi.get("default-kind", DEFAULT_KIND)),
        "annotation_prefixes": _list(cdi.get("annotation-prefixes"), ["cdi.k8s.io/"]),
        "spec_dirs": _list(cdi.get("spec-dirs"), ["/etc/cdi", "/var/run/cdi"]),
        "hook_path": str(hook.get("path", "") or os.path.join(HERE, "nvidia-container-runtime-hook")),
        "skip_mode_detection": bool(hook.get("skip-mode-detection", False)),
        "fakegpu": {
            "config": str(fg.get("config", "")),
            "state": str(fg.get("state", "/tmp/fakegpu.state")),
            "lib_dir": str(fg.get("lib-dir", HERE)),
            "container_lib_dir": str(fg.get("container-lib-dir", DEFAULT_LIB_DIR)),
        },
    }


def resolve_hook_path(path: str) -> str:
    """config.go: ResolveNVIDIAContainerRuntimeHookPath - a bare name is looked up on PATH (and
    beside this program, where `make` installs the stand-in hook); an absolute path is kept."""
    if os.path.isabs(path):
        return path
    for d in [*os.environ.get("PATH", "").split(os.pathsep), HERE]:
        p = os.path.join(d or ".", path)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return os.path.join("/usr/bin", path)


# ---- logging (internal/runtime/logger.go: Logger.Update) -----------------------------------


class Logger:
    """Lines at or above `log-level` go to the config's `debug` file and to runc's `--log` file,
    JSON with `--log-format json` (logrus JSONFormatter: level, msg, time); nothing to stderr.
    containerd-shim-runc-v2 reads the runtime's failure from that file: the last line whose level
    is `error` (process/utils.go: getLastRuntimeError) - debug and info lines are not failures."""

    def __init__(self, cfg: dict[str, Any] | None = None, args: list[str] | None = None) -> None:
        self.level = LEVELS.get((cfg or {}).get("log_level", "info"), LEVELS["info"])
        self.files = [f for f in ((cfg or {}).get("debug", ""), log_file(args or [])) if f and f != "/dev/null"]
        self.json = log_format(args or []) == "json"
        self.lines: list[tuple[str, str]] = []

    def log(self, level: str, msg: str) -> None:
        self.lines.append((level, msg))
        if LEVELS[level] < self.level:
            return
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if self.json:
            line = json.dumps({"level": level, "msg": msg, "time": now}, separators=(",", ":"))
        else:
            line = f'time="{now}" level={level} msg={json.dumps(msg)}'
        for path in self.files:
            try:
                with open(path, "a") as f:
                    f.write(line + "\n")
            except OSError:
                pass

    def debug(self, msg: str) -> None:
        self.log("debug", msg)

    def info(self, msg: str) -> None:
        self.log("info", msg)

    def warning(self, msg: str) -> None:
        self.log("warning", msg)

    def error(self, msg: str) -> None:
        self.log("error", msg)


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


def fakegpu_mig(fg: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPUs in MIG mode and their MIG devices, from the simulated driver's state
    (`fakegpu-ctl dump`): [{index, minor, migs: [{index, uuid, gi, ci}]}], the MIG devices in
    NVML's MIG index order (GPU instance ID, then compute instance ID).  No state: none."""
    state = fg.get("state") or ""
    ctl = os.path.join(fg.get("lib_dir") or "", "fakegpu-ctl")
    if not state or not os.path.isfile(state) or not os.access(ctl, os.X_OK):
        return []
    env = dict(os.environ, FAKEGPU_STATE=state, FAKEGPU_CONFIG=fg.get("config") or "")
    env.pop("FAKEGPU_VISIBLE_DEVICES", None)
    import subprocess

    proc = subprocess.run([ctl, "dump"], env=env, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise ToolkitError(f"fakegpu-ctl dump: {proc.stderr.strip()}")
    dump = json.loads(proc.stdout)
    minors = {d["index"]: d.get("minor_number", d["index"]) for d in dump["devices"]}
    out = []
    for g in dump.get("mig", []):
        if g["mode"] != 1:
            continue
        migs = sorted(
            ({"uuid": ci["uuid"], "gi": gi["id"], "ci": ci["id"]} for gi in g["gpu_instances"]
             for ci in gi["compute_instances"]),
            key=lambda m: (m["gi"], m["ci"]),
        )  # fmt: skip
        for j, m in enumerate(migs):
            m["index"] = j
        out.append({"index": g["index"], "minor": minors[g["index"]], "migs": migs})
    return out


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """/proc/driver/nvidia-caps/mig-minors: `gpu<m>/gi<g>/access` and `.../ci<c>/access` (MIG user guide)."""
    return 3 + gpu_minor * 135 + gi * 9 + (0 if ci is None else 1 + ci)


def _mig_nodes(minor: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    """A MIG device's nodes: its GPU's and the GPU instance's and compute instance's capability
    (internal/platform-support/dgpu/nvml.go: newNvmlMigDiscoverer)."""
    return [
        _node(f"/dev/nvidia{minor}"),
        _node(f"/dev/nvidia-caps/nvidia-cap{cap_minor(minor, m['gi'])}"),
        _node(f"/dev/nvidia-caps/nvidia-cap{cap_minor(minor, m['gi'], m['ci'])}"),
    ]


def _node(path: str) -> dict[str, Any]:
    # The stand-in device node: /dev/null's numbers under NVIDIA's name.  The simulated libraries
    # see the GPUs whose /dev/nvidia<minor> exists (FAKEGPU_VISIBLE_DEVICES=/dev), as the real
    # driver sees only the device nodes the container was given.
    return {"path": path, "hostPath": "/dev/null"}


def common_edits(fg: dict[str, Any]) -> dict[str, Any]:
    """The edits every device of the simulated driver needs: /dev/nvidiactl, the libraries, the
    state, the driver's env, and NVIDIA_VISIBLE_DEVICES=void LAST (pkg/nvcdi/wrapper.go:
    GetCommonEdits appends it to the generated common edits)."""
    lib_dir = fg["container_lib_dir"].rstrip("/")
    mounts = [
        {
            "hostPath": os.path.join(fg["lib_dir"], lib),
            "containerPath": f"{lib_dir}/{lib}",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }
        for lib in LIBS
    ]
    env = [f"FAKEGPU_STATE={CONTAINER_STATE}", "FAKEGPU_VISIBLE_DEVICES=/dev"]
    mounts.append(
        {"hostPath": fg["state"], "containerPath": CONTAINER_STATE, "options": ["rw", "nosuid", "nodev", "bind"]}
    )
    if fg["config"]:
        mounts.append(
            {"hostPath": fg["config"], "containerPath": CONTAINER_CONFIG, "options": ["ro", "nosuid", "nodev", "bind"]}
        )
        env.append(f"FAKEGPU_CONFIG={CONTAINER_CONFIG}")
    env.append("NVIDIA_VISIBLE_DEVICES=void")
    return {"env": env, "deviceNodes": [_node("/dev/nvidiactl")], "mounts": mounts}


def _sorted_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """pkg/nvcdi/spec/builder.go: every spec nvcdi builds goes through transform.NewSimplifier,
    whose sorter orders devices by name and each edits' device nodes and mounts by the number of
    `/` in the (container) path, then the path (pkg/nvcdi/transform/sorter.go)."""

    def by_path(key: str) -> Any:
        return lambda e: (os.path.normpath(e[key]).count("/"), e[key])

    for edits in [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]:
        if edits.get("deviceNodes"):
            edits["deviceNodes"] = sorted(edits["deviceNodes"], key=by_path("path"))
        if edits.get("mounts"):
            edits["mounts"] = sorted(edits["mounts"], key=by_path("containerPath"))
    spec["devices"] = sorted(spec["devices"], key=lambda d: d["name"])
    return spec


def generate_spec(fg: dict[str, Any], kind: str = DEFAULT_KIND) -> dict[str, Any]:
    """The CDI spec of the simulated GPUs as `nvidia-ctk cdi generate` makes it: each GPU by index
    and by UUID, then `all`, sorted by name (recorded with one GPU:
    tests/data/real-traces/nvidia-toolkit/cdi-spec/nvidia.com-gpu.json; with two, the real
    generator on the simulated NVML wrote 0, 1, GPU-.., GPU-.., all), and the common edits."""
    gpus = fakegpu_devices(fg["config"])
    mig = {g["index"]: g for g in fakegpu_mig(fg)}
    devices = []
    every: list[dict[str, Any]] = []
    for g in gpus:
        if g["index"] in mig:
            # lib-nvml.go: getDeviceSpecGeneratorsForAllDevices skips a GPU in MIG mode; each MIG
            # device is named `<gpu>:<mig index>` and by its UUID (namer.go), recorded in
            # tests/data/nvidia-ctk-mig/
            for m in mig[g["index"]]["migs"]:
                edits = {"deviceNodes": _mig_nodes(g["minor"], m)}
                devices.append({"name": f"{g['index']}:{m['index']}", "containerEdits": edits})
                devices.append({"name": m["uuid"], "containerEdits": edits})
                every += [n for n in edits["deviceNodes"] if n not in every]
            continue
        edits = {"deviceNodes": [_node(f"/dev/nvidia{g['minor']}")]}
        devices.append({"name": str(g["index"]), "containerEdits": edits})
        devices.append({"name": g["uuid"], "containerEdits": edits})
        every += [n for n in edits["deviceNodes"] if n not in every]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": every}})
    return _sorted_spec({"cdiVersion": "0.5.0", "kind": kind, "devices": devices, "containerEdits": common_edits(fg)})


def jit_spec(fg: dict[str, Any], ids: list[str]) -> dict[str, Any]:
    """jit-cdi: an in-memory spec of kind runtime.nvidia.com/gpu for exactly the requested ids
    (pkg/nvcdi/lib-nvml.go: getDeviceSpecGeneratorsForIDs - `none` is an empty device, `all`
    every GPU, else an index or UUID; unknown ones fail; no ids means `all`, wrapper.go: GetSpec)."""
    gpus = fakegpu_devices(fg["config"])
    by_id = {str(g["index"]): g for g in gpus} | {g["uuid"]: g for g in gpus}
    migs: dict[str, dict[str, Any]] = {}
    for g in fakegpu_mig(fg):  # a MIG UUID or `<gpu>:<mig index>` (lib-nvml.go: normalizeDeviceID)
        for m in g["migs"]:
            migs[m["uuid"]] = migs[f"{g['index']}:{m['index']}"] = {"minor": g["minor"], **m}
    devices: list[dict[str, Any]] = []
    for i in ids or ["all"]:
        if i == "none":
            devices = [{"name": "none", "containerEdits": {}}]
            break
        if i == "all":
            devices = [{"name": str(g["index"]), "containerEdits": {"deviceNodes": [_node(f"/dev/nvidia{g['minor']}")]}}
                       for g in gpus]  # fmt: skip
            break
        if i in migs:
            m = migs[i]
            devices.append({"name": m["uuid"], "containerEdits": {"deviceNodes": _mig_nodes(m["minor"], m)}})
            continue
        g = by_id.get(i)
        if g is None:
            raise ToolkitError(
                f'failed to generate CDI spec for mode "auto": failed to construct device spec generators: '
                f"failed to get device handle from UUID: ERROR_NOT_FOUND ({i})"
            )
        devices.append({"name": g["uuid"], "containerEdits": {"deviceNodes": [_node(f"/dev/nvidia{g['minor']}")]}})
    return _sorted_spec(
        {"cdiVersion": "0.5.0", "kind": JIT_KIND, "devices": devices, "containerEdits": common_edits(fg)}
    )


# ---- CDI names (cdi/pkg/parser/parser.go) ----------------------------------------------------


def _alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _vendor_or_class_ok(name: str) -> bool:
    """validateVendorOrClassName: a letter first, a letter or digit last, `_-.` between."""
    if not name or not (name[0].isascii() and name[0].isalpha()):
        return False
    if not all(_alnum(c) or c in "_-." for c in name[1:-1]):
        return False
    return _alnum(name[-1])


def _device_name_ok(name: str) -> bool:
    """ValidateDeviceName: a letter or digit first and last, `_-.:` between."""
    if not name or not _alnum(name[0]):
        return False
    if len(name) == 1:
        return True
    return all(_alnum(c) or c in "_-.:" for c in name[1:-1]) and _alnum(name[-1])


def qualified(device: str) -> bool:
    """IsQualifiedName: vendor/class=name, each part valid (ParseDevice, ParseQualifier)."""
    if not device or device[0] == "/":
        return False
    kind, sep, name = device.partition("=")
    if not sep or not kind or not name:
        return False
    vendor, slash, cls = kind.partition("/")
    if not slash or not vendor or not cls:
        return False
    return _vendor_or_class_ok(vendor) and _vendor_or_class_ok(cls) and _device_name_ok(name)


# ---- the container's requests (internal/config/image/cuda_image.go, devices.go) -------------


class Image:
    """CUDA image model of one OCI spec (image.NewCUDAImageFromSpec / image.New)."""

    def __init__(
        self, spec: dict[str, Any], cfg: dict[str, Any], logger: Logger, *, annotation_prefixes: list[str]
    ) -> None:
        self.logger = logger
        self.env: dict[str, str] = {}
        for item in ((spec.get("process") or {}).get("env")) or []:
            # builder.go: WithEnv - a map filled in order: the LAST occurrence of a key wins
            # (containerd keeps the image's NVIDIA_VISIBLE_DEVICES=all ahead of the plugin's value).
            key, sep, value = str(item).partition("=")
            if not sep:
                raise ToolkitError(f"invalid environment variable: {item}")
            self.env[key] = value
        self.mounts = [m for m in spec.get("mounts") or [] if isinstance(m, dict)]
        self.annotations = {str(k): str(v) for k, v in (spec.get("annotations") or {}).items()}
        caps = ((spec.get("process") or {}).get("capabilities") or {}).get("bounding") or []
        self.privileged = "CAP_SYS_ADMIN" in caps  # privileged.go: IsPrivileged (bounding set)
        self.prefixes = list(annotation_prefixes)
        self.accept_mounts = bool(cfg["accept_volume_mounts"])
        self.accept_env = bool(cfg["accept_envvar_unprivileged"])
        swarm = [s.strip() for e in cfg.get("swarm_resource", "").split(",") if (s := e.strip())]
        self.preferred = swarm

    def is_legacy(self) -> bool:
        """IsLegacy: CUDA_VERSION set, NVIDIA_REQUIRE_CUDA not."""
        return bool(self.env.get("CUDA_VERSION")) and not self.env.get("NVIDIA_REQUIRE_CUDA")

    def _visible_env_vars(self) -> list[str]:
        got = [e for e in self.preferred if e in self.env]
        return got or ["NVIDIA_VISIBLE_DEVICES"]

    def devices_from_envvars(self, names: list[str]) -> list[str]:
        """devicesFromEnvvars + NewVisibleDevices(...).List()."""
        is_set = False
        devices: list[str] = []
        for name in names:
            if name in self.env:
                is_set = True
                devices += [t for d in self.env[name].split(",") if (t := d.strip())]
        if not is_set and not devices and self.is_legacy():
            devices = ["all"]
        if not devices or "void" in devices:
            devices = ["void"]
        for d in devices:  # NewVisibleDevices: the first special value decides
            if d == "all":
                return ["all"]
            if d == "none":
                return [""]  # none.List()
            if d in ("", "void"):
                return []  # void.List(): nil
        # newDevices/List: an id's LAST index wins and earlier slots stay "" (a quirk kept as is)
        lookup = {d: i for i, d in enumerate(devices)}
        out = [""] * len(devices)
        for d, i in lookup.items():
            out[i] = d
        return out

    def from_annotations(self) -> list[str]:
        """cdiDeviceRequestsFromAnnotations: keys with a configured prefix, sorted, each value
        split at commas as is (no trimming)."""
        if not self.prefixes or not self.annotations:
            return []
        keys = sorted(k for k in self.annotations if any(k.startswith(p) for p in self.prefixes))
        out: list[str] = []
        for k in keys:
            out += self.annotations[k].split(",")
        return out

    def requests_from_mounts(self) -> list[str]:
        """requestsFromMounts: /dev/null sources, cleaned destinations under the root (no `/`
        needed after it), each once, the rest with `/` trimmed."""
        seen: set[str] = set()
        out: list[str] = []
        for m in self.mounts:
            if os.path.normpath(str(m.get("source", "")) or ".") != "/dev/null":
                continue
            dst = os.path.normpath(str(m.get("destination", "")) or ".")
            if dst in seen:
                continue
            seen.add(dst)
            if not dst.startswith(VOLUME_ROOT):
                continue
            dev = dst[len(VOLUME_ROOT) :].strip("/")
            if dev:
                out.append(dev)
        return out

    def from_mounts(self) -> list[str]:
        """visibleDevicesFromMounts: imex/ requests skipped, cdi/ requests as qualified names
        (cdiDeviceMountRequest.qualifiedName), invalid ones skipped with a warning."""
        out: list[str] = []
        for d in self.requests_from_mounts():
            if d.startswith("imex/"):
                continue
            if d.startswith("cdi/"):
                name = d[4:]
                if not qualified(name):
                    parts = name.split("/", 2)
                    if len(parts) != 3:
                        self.logger.warning(f"Ignoring invalid mount request for CDI device {d}")
                        continue
                    name = f"{parts[0]}/{parts[1]}={parts[2]}"
                out.append(name)
                continue
            out.append(d)
        return out

    def visible_devices(self) -> list[str]:
        """VisibleDevices: annotations, else (accepted) volume mounts, else the env (privileged
        or accepted; otherwise a warning and nothing)."""
        got = self.from_annotations()
        if got:
            return got
        if self.accept_mounts:
            got = self.from_mounts()
            if got:
                return got
        env = self.devices_from_envvars(self._visible_env_vars())
        if not env:
            return []
        if self.privileged or self.accept_env:
            return env
        self.logger.warning(
            f"Ignoring devices requested by environment variable(s) in unprivileged container: "
            f"{self._visible_env_vars()}"
        )
        return []

    def only_fully_qualified(self) -> bool:
        """OnlyFullyQualifiedCDIDevices: at least one request, every one a CDI name."""
        devs = self.visible_devices()
        return bool(devs) and all(qualified(d) for d in devs)


def resolve_mode(mode: str, image: Image, default: str, logger: Logger) -> str:
    """internal/info/auto.go: ResolveRuntimeMode - a set mode is used as is; `auto` is `cdi`
    when every request is a fully qualified CDI name, else the default: jit-cdi for the runtime
    (NewRuntimeModeResolver), legacy for the hook (assertModeIsLegacy: WithDefaultMode)."""
    if mode != "auto":
        logger.info(f"Using requested mode '{mode}'")
        return mode
    got = "cdi" if image.only_fully_qualified() else default
    logger.info(f"Auto-detected mode as '{got}'")
    return got


def runtime_image(spec: dict[str, Any], cfg: dict[str, Any], forced: str | None, logger: Logger) -> tuple[str, Image]:
    """internal/runtime/runtime_factory.go: initRuntimeModeAndImage - the mode is resolved on an
    image that sees the CDI annotations; outside cdi mode the image is built again without them
    (annotations are ignored in legacy and jit-cdi mode)."""
    mode = forced or cfg["mode"]
    image = Image(spec, cfg, logger, annotation_prefixes=cfg["annotation_prefixes"])
    mode = resolve_mode(mode, image, "jit-cdi", logger)
    if mode not in MODES:
        raise ToolkitError(f'failed to construct OCI spec modifier: invalid mode "{mode}"')
    if mode == "csv":
        raise ToolkitError("csv mode (Tegra) is not modelled by the simulated toolkit")
    if mode != "cdi":
        image = Image(spec, cfg, logger, annotation_prefixes=[])
    return mode, image


# ---- CDI specs (cdi/pkg/cdi/cache.go, spec.go, spec-dirs.go) ----------------------------------


def _read_spec_file(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".yaml"):  # spec.go: ReadSpec parses YAML (JSON is YAML too)
        try:
            import yaml
        except ImportError:
            raise ToolkitError(f"{path}: a YAML CDI spec needs PyYAML (Debian: python3-yaml)") from None
        doc = yaml.safe_load(data)
    else:
        doc = json.loads(data)
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        raise ValueError("not a CDI spec (no kind)")
    return doc


def load_registry(dirs: list[str], logger: Logger) -> dict[str, dict[str, Any]]:
    """qualified name -> {spec, device} over every `.json`/`.yaml` spec in `dirs` (spec-dirs.go:
    scanSpecDirs; other extensions are skipped).  A spec that fails to load is left out and only
    logged (Refresh errors are not fatal, modifier/cdi/registry.go); a later dir has the higher
    priority and wins a name."""
    out: dict[str, dict[str, Any]] = {}
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for n in names:
            if not n.endswith((".json", ".yaml")):
                continue
            path = os.path.join(d, n)
            try:
                spec = _read_spec_file(path)
            except (OSError, ValueError) as e:
                logger.debug(f"The following error was triggered when refreshing the CDI registry: {path}: {e}")
                continue
            for dev in spec.get("devices") or []:
                out[f"{spec['kind']}={dev.get('name')}"] = {"spec": spec, "device": dev}
    return out


def _count_sep(dest: str) -> int:
    return os.path.normpath(dest or ".").count("/")


def apply_edits(spec: dict[str, Any], edits: dict[str, Any]) -> None:
    """One ContainerEdits.Apply (cdi/pkg/cdi/container-edits.go) into an OCI spec:

    - env through runtime-tools' AddMultipleProcessEnv (generate.go: addEnv): the generator's
      index is keyed by the WHOLE existing `KEY=VALUE` entries but by the key for entries this
      Apply adds, so `NVIDIA_VISIBLE_DEVICES=void` is appended after an existing
      `NVIDIA_VISIBLE_DEVICES=<x>` (recorded in runtime-edit/*/container.after.config.json);
    - device nodes: missing type/numbers/mode from the host path (container-edits_unix.go:
      fillMissingInfo), uid/gid of a non-root process user, replaced by path or appended, and an
      allow rule (`rwm` unless `permissions`) appended for char/block devices;
    - mounts: an existing one at the same destination removed, appended, then all mounts sorted
      (stable) by the number of `/` in the cleaned destination (sortMounts);
    - hooks appended to their phase."""

    def sub(parent: dict[str, Any], key: str) -> dict[str, Any]:  # runtime-tools' initConfig*
        if not isinstance(parent.get(key), dict):
            parent[key] = {}
        child: dict[str, Any] = parent[key]
        return child

    if edits.get("env"):
        proc = sub(spec, "process")
        env = list(proc.get("env") or [])
        index = {e: i for i, e in enumerate(env)}
        for item in edits["env"]:
            key = item.split("=", 1)[0]
            if key in index:
                env[index[key]] = item
            else:
                env.append(item)
                index[key] = len(env) - 1
        proc["env"] = env
    proc_now = spec.get("process")
    user = (proc_now.get("user") if isinstance(proc_now, dict) else None) or {}
    for dn in edits.get("deviceNodes") or []:
        node = _fill_device(dn)
        if "uid" not in node and int(user.get("uid") or 0) > 0:
            node["uid"] = int(user["uid"])
        if "gid" not in node and int(user.get("gid") or 0) > 0:
            node["gid"] = int(user["gid"])
        linux = sub(spec, "linux")
        devs = list(linux.get("devices") or [])
        for i, d in enumerate(devs):  # RemoveDevice: the first one at this path
            if d.get("path") == node["path"]:
                del devs[i]
                break
        linux["devices"] = [*devs, node]
        if node["type"] in ("b", "c"):
            res = sub(linux, "resources")
            res["devices"] = [*(res.get("devices") or []), {
                "allow": True, "type": node["type"], "major": node["major"], "minor": node["minor"],
                "access": dn.get("permissions") or "rwm"}]  # fmt: skip
    if edits.get("mounts"):
        mounts = list(spec.get("mounts") or [])
        for m in edits["mounts"]:
            for i, old in enumerate(mounts):  # RemoveMount: the first one at this destination
                if old.get("destination") == m["containerPath"]:
                    del mounts[i]
                    break
            new: dict[str, Any] = {"destination": m["containerPath"], "source": m["hostPath"]}
            if m.get("options"):
                new["options"] = list(m["options"])
            if m.get("type"):
                new["type"] = m["type"]
            mounts.append(new)
        spec["mounts"] = sorted(mounts, key=lambda x: _count_sep(str(x.get("destination", ""))))
    phases = ("prestart", "poststart", "poststop", "createRuntime", "createContainer", "startContainer")
    for h in edits.get("hooks") or []:
        if h.get("hookName") not in phases:
            raise ToolkitError(f"unknown hook name {h.get('hookName')!r}")
        entry = {k: h[k] for k in ("path", "args", "env", "timeout") if h.get(k) is not None}
        hooks = spec.get("hooks")
        if not isinstance(hooks, dict):
            hooks = spec["hooks"] = {}
        hooks.setdefault(h["hookName"], []).append(entry)


def _fill_device(dn: dict[str, Any]) -> dict[str, Any]:
    """DeviceNode.fillMissingInfo + toOCI: only the fields that are set."""
    kind, major, minor = dn.get("type", ""), int(dn.get("major") or 0), int(dn.get("minor") or 0)
    mode = dn.get("fileMode")
    minimal = kind != "" and (major != 0 or kind == "p")
    host = dn.get("hostPath") or dn["path"]
    try:
        st = os.lstat(host)
        fmt = stat.S_IFMT(st.st_mode)
        if fmt not in (stat.S_IFBLK, stat.S_IFCHR, stat.S_IFIFO):
            raise OSError("not a device node")
    except OSError as e:
        if not minimal:
            raise ToolkitError(f'failed to stat CDI host device "{host}": {e}') from None
    else:
        if mode is None:
            mode = stat.S_IMODE(st.st_mode)
        if not minimal:
            real = {stat.S_IFBLK: "b", stat.S_IFCHR: "c", stat.S_IFIFO: "p"}[fmt]
            if kind == "":
                kind = real
            elif kind != real:
                raise ToolkitError(f'CDI device ("{dn["path"]}", "{host}"), host type mismatch ({kind}, {real})')
            if kind != "p" and major == 0:
                major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    node: dict[str, Any] = {"path": dn["path"], "type": kind, "major": major, "minor": minor}
    if mode is not None:
        node["fileMode"] = int(mode)
    for k in ("uid", "gid"):
        if dn.get(k) is not None:
            node[k] = int(dn[k])
    return node


def inject_cdi(spec: dict[str, Any], names: list[str], registry: dict[str, dict[str, Any]]) -> None:
    """cache.go: InjectDevices - unknown names fail (`unresolvable CDI devices <names>`); the
    edits of each device's spec (once per spec) and of the device are appended into ONE set of
    edits, applied in one go."""
    missing = [n for n in names if n not in registry]
    if missing:
        raise ToolkitError(f"failed to inject CDI devices: unresolvable CDI devices {', '.join(missing)}")
    combined: dict[str, list[Any]] = {"env": [], "deviceNodes": [], "mounts": [], "hooks": []}
    seen: list[int] = []
    for n in names:
        entry = registry[n]
        parts = []
        if id(entry["spec"]) not in seen:
            seen.append(id(entry["spec"]))
            parts.append(entry["spec"].get("containerEdits") or {})
        parts.append(entry["device"].get("containerEdits") or {})
        for p in parts:
            for k in combined:
                combined[k] += list(p.get(k) or [])
    apply_edits(spec, combined)


# ---- the runtime (internal/runtime, internal/modifier) ---------------------------------------


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def modify(spec: dict[str, Any], cfg: dict[str, Any], forced: str | None = None, logger: Logger | None = None) -> str:
    """What the runtime does to config.json on `create`; returns the mode used.

    legacy (modifier/stable.go): appends `<hook path> prestart` to hooks.prestart, once, at the
    END (our base_runtime_spec hooks stay first).  cdi / jit-cdi (modifier/factory.go:
    supportedModifierTypes): removes NVIDIA's own prestart hooks (hook_remover.go), then
    (modifier/cdi.go: newCDIModifier) takes the requests (`""` -> `none`, unqualified ->
    `<default-kind>=<name>`, runtime.nvidia.com/gpu in jit-cdi), each once; none: no change.
    runtime.nvidia.com/gpu names get a spec generated in memory (jit) whose device edits are
    applied one by one, then its common edits (cdi/spec.go: fromCDISpec.Modify); other names go
    through the spec dirs (cdi/registry.go: fromRegistry)."""
    logger = logger or Logger()
    mode, image = runtime_image(spec, cfg, forced, logger)
    hooks = spec.get("hooks") if isinstance(spec.get("hooks"), dict) else None
    pre = list((hooks or {}).get("prestart") or [])
    if mode == "legacy":
        if not any(os.path.basename(str(h.get("path", ""))) in NVIDIA_HOOKS for h in pre):
            path = resolve_hook_path(cfg["hook_path"])
            logger.info(f"Using prestart hook path: {path}")
            pre.append({"path": path, "args": [os.path.basename(path), "prestart"]})
            if hooks is None:
                hooks = spec["hooks"] = {}
            hooks["prestart"] = pre
        return mode
    kept = [h for h in pre if os.path.basename(str(h.get("path", ""))) not in NVIDIA_HOOKS]
    if hooks is not None and kept != pre:
        if kept:
            hooks["prestart"] = kept
        else:
            del hooks["prestart"]
    kind = JIT_KIND if mode == "jit-cdi" else cfg["default_kind"]
    devices = _dedupe([n if qualified(n) else f"{kind}={n}" for n in ((d or "none") for d in image.visible_devices())])
    if not devices:
        logger.debug("No devices requested; no modification required.")
        return mode
    automatic = [d for d in devices if d.startswith(JIT_KIND + "=")]
    if automatic and len(automatic) != len(devices):
        raise ToolkitError(
            "requesting a CDI device with vendor 'runtime.nvidia.com' is not supported when requesting "
            "other CDI devices"
        )
    if automatic:
        logger.debug(f"Using automatic CDI modfier for devices {automatic}")
        generated = jit_spec(cfg["fakegpu"], [d[len(JIT_KIND) + 1 :] for d in automatic])
        for dev in generated["devices"]:
            apply_edits(spec, dev.get("containerEdits") or {})
        apply_edits(spec, generated["containerEdits"])
        return mode
    logger.debug(f"Creating CDI modifier for devices: [{' '.join(devices)}]")
    logger.debug(f"Injecting devices using CDI: [{' '.join(devices)}]")
    inject_cdi(spec, devices, load_registry(cfg["spec_dirs"], logger))
    return mode


# ---- the runtime's argv (internal/oci/args.go, logger.go: parseArgs) ------------------------


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


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        for form in (f"--{name}", f"-{name}"):
            if a == form and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(form + "="):
                return a[len(form) + 1 :]
    return None


def log_file(args: list[str]) -> str | None:
    return _flag(args, "log")


def log_format(args: list[str]) -> str:
    return _flag(args, "log-format") or "text"


def low_level_runtime(cfg: dict[str, Any], logger: Logger) -> str:
    """oci.NewLowLevelRuntime: the first of `runtimes` found (an absolute path, else on PATH)."""
    for name in cfg["runtimes"]:
        if os.path.isabs(name) and os.access(name, os.X_OK):
            return str(name)
        for d in os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
            p = os.path.join(d or ".", name)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                logger.debug("Found 1 candidates; ignoring further candidates")
                return p
    raise ToolkitError(
        f"error constructing low-level runtime: no runtime binary found from candidate list: {cfg['runtimes']}"
    )


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


def runtime_main(argv: list[str], forced: str | None = None) -> int:
    """rt.Run (internal/runtime/runtime.go): errors are logged at level error to the log files
    (where containerd reads the reason) and the program exits 1."""
    args = argv[1:]
    logger = Logger(None, args)
    try:
        cfg = load_config()
        logger = Logger(cfg, args)
        runtime = low_level_runtime(cfg, logger)
        if has_create(args):
            path = os.path.join(bundle_dir(args), "config.json")
            logger.debug(f"Using bundle directory: {bundle_dir(args)}")
            logger.info(f"Using OCI specification file path: {path}")
            try:
                with open(path) as f:
                    spec = json.load(f)
            except (OSError, ValueError) as e:
                raise ToolkitError(f"error loading OCI specification for modification: {e}") from None
            logger.debug("Create command detected; applying OCI specification modifications")
            try:
                modify(spec, cfg, forced, logger)
            except ToolkitError as e:
                raise ToolkitError(
                    f"could not apply required modification to OCI specification: error modifying OCI spec: {e}"
                ) from None
            write_json_atomic(path, spec)
            logger.debug("Applied required modification to OCI specification")
        logger.debug(f"Forwarding command to runtime {runtime}")
    except ToolkitError as e:
        logger.error(str(e))
        return 1
    os.execv(runtime, [runtime, *args])
    return 127  # not reached


# ---- the legacy hook (cmd/nvidia-container-runtime-hook) --------------------------------------

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
    """What nvidia-container-cli sets up for the device list the hook passes (`--device=`):
    indexes, UUIDs, `all`; `""` (from `none`) = the driver only.  The same edits as the CDI spec
    (one source of truth)."""
    state = cfg["fakegpu"]["state"]
    if not os.path.isfile(state):
        raise ToolkitError(f"fakegpu state {state} does not exist (set [fakegpu] state in {cfg['path']})")
    spec = generate_spec(cfg["fakegpu"])
    by_name = {d["name"]: d for d in spec["devices"]}
    nodes: list[dict[str, Any]] = []
    for n in names:
        if n in ("", "none"):
            continue
        if n not in by_name:
            raise ToolkitError(f"device error: {n}: unknown device")
        nodes += by_name[n]["containerEdits"]["deviceNodes"]
    edits = dict(spec["containerEdits"])
    edits["deviceNodes"] = list(edits["deviceNodes"]) + nodes
    return edits


def hook_devices(spec: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """The devices the hook hands to nvidia-container-cli, [] when this is no GPU container, or
    ToolkitError(HOOK_MODE_ERROR) when the mode is not legacy (container_config.go:
    getContainerConfig builds the image WITHOUT annotation prefixes; hook_config.go:
    assertModeIsLegacy - skipped with `skip-mode-detection`, else the config's mode resolved with
    legacy as the default, which must be legacy; only checked for a GPU container, main.go)."""
    logger = Logger()
    image = Image(spec, cfg, logger, annotation_prefixes=[])
    devices = image.visible_devices()
    if not devices:
        return []
    if not cfg["skip_mode_detection"]:
        mode = resolve_mode(cfg["mode"], image, "legacy", logger)
        # main.go: logInterceptor.Infof is log.Printf - the resolver's info line goes to stderr
        for level, msg in logger.lines:
            if level == "info":
                print(msg, file=sys.stderr)
        if mode != "legacy":
            raise ToolkitError(HOOK_MODE_ERROR)
    return devices


def hook_main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "prestart":
        return 0  # poststart/poststop: nothing to do
    try:
        state = json.loads(sys.stdin.read())
        bundle, pid = str(state["bundle"]), int(state["pid"])
        cfg = load_config()
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
        names = hook_devices(spec, cfg)
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
        # main.go: log.SetFlags(0); log.Panicf(...) prints the message alone, exit() exits 1.
        msg = str(e)
        print(msg if msg == HOOK_MODE_ERROR else f"nvidia-container-cli: {msg}", file=sys.stderr)
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
