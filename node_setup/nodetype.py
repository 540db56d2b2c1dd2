"""Node detection: how this node's containerd and NVIDIA toolkit put a GPU into a container.

`detect()` returns one `NodeFacts` struct (msgspec): the effective containerd config,
every `nvidia*` runtime handler with its `BinaryName`, the toolkit config that runtime
reads, CDI state and specs, and the node type:

- `N1-legacy`   host toolkit, `nvidia` handler, legacy mode (toolkit <= 1.17 `auto`, or `legacy`)
- `N1-jit-cdi`  host toolkit >= 1.18 in `auto`/`jit-cdi` mode (builds CDI edits in memory)
- `N1-cdi`      host toolkit in `cdi` mode (`nvidia-ctk config` with mode = "cdi"; usually
                `nvidia-ctk runtime configure --cdi.enabled` and `nvidia-ctk cdi generate`)
- `N2`          the GPU Operator's toolkit (wrappers under /usr/local/nvidia/toolkit) in `auto` mode
- `N3`          the GPU Operator's toolkit in `cdi` mode (its installer also sets
                `nvidia-container-runtime-hook.skip-mode-detection = true`)
- `none`        no NVIDIA runtime handler

Installer side only (`vgpu-hook containerd ...`, `vgpuctl doctor`): msgspec and tomllib are
fine here; the per-container hook path (hotpath/oci/prestart) never imports this module.

Every file is read under `Root` (`--root DIR`, the host's `/` mounted into an installer
container): paths named *in* configs are host paths and are resolved inside DIR, symlinks
included (an absolute link target is the host's, so it is re-rooted, never followed into
the installer's own filesystem).
"""

from __future__ import annotations

import copy
import glob
import json
import os
import subprocess
from typing import Any, Literal

import msgspec

try:
    import tomllib

    _TOMLError: type[Exception] = tomllib.TOMLDecodeError

    def _loads(text: str) -> dict[str, Any]:
        return tomllib.loads(text)

except ImportError:  # Python 3.10: tomlkit (a dependency of the installer already)
    import tomlkit
    import tomlkit.exceptions

    _TOMLError = tomlkit.exceptions.TOMLKitError

    def _loads(text: str) -> dict[str, Any]:
        return tomlkit.parse(text).unwrap()


V1_CRI = "cri"
V2_CRI = "io.containerd.grpc.v1.cri"
V3_RUNTIME = "io.containerd.cri.v1.runtime"
CONFIG_VERSIONS = (1, 2, 3, 4)  # 4: containerd >= 2.3 (version/version.go: ConfigVersion)
OPERATOR_TOOLKIT = "/usr/local/nvidia/toolkit"
HOST_TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
OPERATOR_TOOLKIT_CONFIG = OPERATOR_TOOLKIT + "/.config/nvidia-container-runtime/config.toml"
NVIDIA_BINARIES = ("nvidia-container-runtime", "nvidia-container-toolkit")
DEFAULT_CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]
MAX_FILE = 4 << 20  # configs, wrappers and CDI specs larger than this are not read

NodeType = Literal["N1-legacy", "N1-jit-cdi", "N1-cdi", "N2", "N3", "none"]


class DetectError(Exception):
    pass


class Handler(msgspec.Struct, kw_only=True):
    """One `containerd.runtimes.<name>` table of the effective config."""

    name: str
    runtime_type: str = ""
    binary_name: str = ""  # options.BinaryName ("" = runc on PATH)
    base_runtime_spec: str = ""
    container_annotations: list[str] = msgspec.field(default_factory=list)
    nvidia: bool = False  # reaches an NVIDIA runtime (name nvidia* or BinaryName nvidia-container-runtime*)
    binary_exists: bool = False
    table: dict[str, Any] = msgspec.field(default_factory=dict)  # the whole table, as configured


class ToolkitConfig(msgspec.Struct, kw_only=True):
    """The nvidia-container-runtime config.toml a handler's runtime reads."""

    path: str
    exists: bool = False
    error: str = ""
    mode: str = "auto"
    runtimes: list[str] = msgspec.field(default_factory=lambda: ["runc", "crun"])
    default_kind: str = "nvidia.com/gpu"
    annotation_prefixes: list[str] = msgspec.field(default_factory=lambda: ["cdi.k8s.io/"])
    spec_dirs: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_CDI_DIRS))
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = False
    swarm_resource: str = ""  # env vars preferred over NVIDIA_VISIBLE_DEVICES ("" = none)
    skip_mode_detection: bool = False  # [nvidia-container-runtime-hook] skip-mode-detection

    def legacy_hook_accepts(self) -> bool:
        """Whether NVIDIA's legacy hook, reading this config, sets a GPU up for a container that
        names it by UUID (hook_config.go@v1.20.0: assertModeIsLegacy): with skip-mode-detection,
        or when the mode resolves to legacy - `legacy`, or `auto` (the hook's default is legacy;
        auto is cdi only when every request is a CDI name).  In `cdi` or `jit-cdi` mode it
        refuses: "invoking the NVIDIA Container Runtime Hook directly ... is not supported"."""
        return self.skip_mode_detection or self.mode in ("legacy", "auto")


class CDISpec(msgspec.Struct, kw_only=True):
    path: str
    kind: str = ""
    devices: list[str] = msgspec.field(default_factory=list)
    error: str = ""


class NodeFacts(msgspec.Struct, kw_only=True):
    root: str
    containerd_config: str  # host path of the main config
    config_exists: bool = False
    containerd_bin: str = ""  # host path, "" when none
    containerd_version: str = ""  # e.g. "1.6.20"; "" when unknown
    containerd_major: int = 1
    config_version: int = 2
    cri_plugin: str = V2_CRI
    source: str = "files"  # "config dump" or "files"
    source_note: str = ""  # why `config dump` was not used
    files: list[str] = msgspec.field(default_factory=list)  # merge order, host paths
    cri_file: str = ""  # 1.x: the file whose CRI section is the effective one
    default_runtime: str = "runc"
    handlers: list[Handler] = msgspec.field(default_factory=list)
    nvidia_handler: str = ""  # the handler install copies ("" = none)
    legacy_binary: str = ""  # `<BinaryName>.legacy` when it exists
    cri_error: str = ""  # why containerd's CRI plugin will not load with this config ("" = it loads)
    toolkit: ToolkitConfig | None = None
    toolkit_version: str = ""
    cdi_enabled: bool = False
    cdi_spec_dirs: list[str] = msgspec.field(default_factory=list)
    cdi_specs: list[CDISpec] = msgspec.field(default_factory=list)
    node_type: NodeType = "none"
    notes: list[str] = msgspec.field(default_factory=list)

    def handler(self, name: str) -> Handler | None:
        for h in self.handlers:
            if h.name == name:
                return h
        return None


# ---- the host tree ------------------------------------------------------------


class Root:
    """Host paths resolved inside a directory that holds the host's `/`."""

    def __init__(self, root: str = "/") -> None:
        self.root = os.path.realpath(root or "/")

    @property
    def is_host(self) -> bool:
        return self.root == "/"

    def fs(self, host_path: str) -> str:
        """Where the host path `host_path` is on this filesystem.

        Symlinks are followed one component at a time inside the root: an absolute
        target names a host path, and `..` never climbs above the root (40 links at
        most, as the kernel).  A missing component ends the walk (the rest is joined).
        """
        if self.is_host:
            return host_path
        parts = [p for p in host_path.split("/") if p and p != "."]
        done: list[str] = []
        links = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if done:
                    done.pop()
                continue
            cur = os.path.join(self.root, *done, name)
            try:
                target = os.readlink(cur)
            except OSError:
                done.append(name)  # not a link, or absent
                continue
            links += 1
            if links > 40:
                raise DetectError(f"{host_path}: too many levels of symbolic links under {self.root}")
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
        return os.path.join(self.root, *done)

    def exists(self, host_path: str) -> bool:
        return bool(host_path) and os.path.exists(self.fs(host_path))

    def read(self, host_path: str) -> str | None:
        """Text of a host file (None when absent); newlines kept exactly."""
        try:
            with open(self.fs(host_path), encoding="utf-8", newline="") as f:
                return f.read(MAX_FILE)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise DetectError(f"cannot read {host_path}: {e}") from None

    def glob(self, host_pattern: str) -> list[str]:
        """Host paths matching a host glob (sorted, as containerd's filepath.Glob)."""
        d, pat = os.path.split(host_pattern)
        base = self.fs(d or "/")
        out = sorted(glob.glob(os.path.join(glob.escape(base), pat)))
        return [os.path.join(d, os.path.basename(p)) for p in out]

    def command(self, host_exe: str, *args: str) -> list[str]:
        """argv running a host binary (under `chroot DIR` when DIR is not /)."""
        return [host_exe, *args] if self.is_host else ["chroot", self.root, host_exe, *args]

    def run(self, host_exe: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str] | None:
        # cwd /: as the daemon runs (systemd), so that `config dump` resolves a relative import
        # as containerd itself does (1.6 globs it from the working directory).
        try:
            return subprocess.run(
                self.command(host_exe, *args), capture_output=True, text=True, timeout=timeout, cwd="/"
            )
        except (OSError, subprocess.TimeoutExpired):
            return None


# ---- containerd config --------------------------------------------------------


def cri_plugin_name(config_version: int) -> str:
    return {1: V1_CRI, 3: V3_RUNTIME, 4: V3_RUNTIME}.get(config_version, V2_CRI)


# containerd 2.x migrates every file older than its config version before merging it
# (cmd/containerd/server/config/config.go@v2.3.4: LoadConfigWithPlugins, MigrateConfigTo): version
# 1 plugin names become URIs (v1MigratePluginName), and the CRI runtime plugin takes what it
# owns from a version 2 `io.containerd.grpc.v1.cri` section (plugins/cri/runtime/plugin.go:
# configMigration, migrateConfig) - so a toolkit's version 2 drop-in is merged into 2.x's
# `io.containerd.cri.v1.runtime` (recorded: containerd2/merge/dump.main+version2-syntax-dropin.toml).
_V1_PLUGIN_NAMES = {"cri": V2_CRI}
_NOT_RUNTIME = {
    "cni", "containerd", "sandbox_image", "registry", "image_decryption", "max_concurrent_downloads",
    "image_pull_progress_timeout", "image_pull_with_sync_fs", "stats_collect_period", "disable_tcp_service",
    "stream_server_address", "stream_server_port", "stream_idle_timeout", "enable_tls_streaming",
    "x509_key_pair_streaming",
}  # fmt: skip
_NOT_RUNTIME_CTD = {"snapshotter", "disable_snapshot_annotations", "discard_unpacked_layers"}


def migrate_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    """A parsed config file of version 1 or 2 as containerd 2.x merges it (a copy)."""
    doc = copy.deepcopy(doc)
    version = doc.get("version", 1)
    plugins = doc.get("plugins")
    if not isinstance(plugins, dict) or not isinstance(version, int) or version >= 3:
        return doc
    if version <= 1:
        plugins = {_V1_PLUGIN_NAMES.get(k, k): v for k, v in plugins.items()}
        doc["plugins"] = plugins
    src = plugins.get(V2_CRI)
    if not isinstance(src, dict):
        return doc
    dst = plugins.get(V3_RUNTIME)
    if not isinstance(dst, dict):
        dst = plugins[V3_RUNTIME] = {}
    for k, v in src.items():
        if k not in _NOT_RUNTIME and k not in dst:
            dst[k] = copy.deepcopy(v)
    cni = src.get("cni")
    if isinstance(cni, dict):
        new_cni = dst.setdefault("cni", {})
        for k, v in cni.items():
            if k == "bin_dir":
                if not new_cni.get("bin_dirs"):
                    new_cni["bin_dirs"] = [v]
            elif k not in new_cni:
                new_cni[k] = copy.deepcopy(v)
    ctd = src.get("containerd")
    if isinstance(ctd, dict):
        new_ctd = dst.setdefault("containerd", {})
        for k, v in ctd.items():
            if k not in _NOT_RUNTIME_CTD and k not in new_ctd:
                new_ctd[k] = copy.deepcopy(v)
    return doc


def cri_load_error(facts_major: int, ctd: dict[str, Any]) -> str:
    """Why the CRI plugin refuses this effective `containerd` section, "" when it loads: the
    default runtime must be one of `runtimes` (pkg/cri/config/config.go@v1.7.34:
    ValidatePluginConfig; internal/cri/config/config.go@v2.3.4: ValidateRuntimeConfig).
    containerd then runs without CRI and the kubelet cannot start any pod."""
    name = ctd.get("default_runtime_name")
    if facts_major >= 2 and name == "":
        return "`default_runtime_name` is empty"
    name = name or "runc"
    configured = ctd.get("runtimes")
    runtimes: dict[str, Any] = dict(configured) if isinstance(configured, dict) else {}
    if facts_major >= 2 or not isinstance(configured, dict):
        # containerd's built-in `runc`: 1.x keeps it only while no file defines a `runtimes`
        # table (1.6.20 and 1.7.34 `config dump` of a file defining only `vgpu`: runc gone); 2.x
        # merges the configured runtimes into its defaults (2.3.4: runc kept).
        runtimes.setdefault("runc", {})
    if name not in runtimes:
        return (
            f"no corresponding runtime configured in `containerd.runtimes` for `containerd` "
            f'`default_runtime_name = "{name}"'  # containerd's message, unbalanced backtick included
        )
    return ""


def _toml(text: str, where: str) -> dict[str, Any]:
    try:
        return _loads(text)
    except _TOMLError as e:
        raise DetectError(f"cannot parse {where}: {e}") from None


def _deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def _import_patterns(doc: dict[str, Any], host_path: str, relative_to_cwd: bool = False) -> list[str]:
    """Absolute import patterns.  A relative one is joined to the importing file's directory
    (services/server/config/config.go@v1.7.34 and cmd/containerd/server/config/config.go@v2.3.4:
    resolveImports), except on containerd <= 1.6, which globs it from the process's working
    directory - `/` for the daemon (recorded: containerd2/contrast-containerd-1.6.20/
    dump.relative-glob-from-cwd-slash.toml imports nothing)."""
    imports = doc.get("imports") or []
    if not isinstance(imports, list):
        return []
    out = []
    for p in imports:
        if isinstance(p, str) and p:
            base = "/" if relative_to_cwd else os.path.dirname(host_path)
            out.append(os.path.normpath(p if p.startswith("/") else os.path.join(base, p)))
    return out


def load_files(
    root: Root, conf: str, major: int, relative_to_cwd: bool = False
) -> tuple[dict[str, Any], list[str], dict[str, dict[str, Any]]]:
    """Effective config from the files alone, with containerd's merge rules.

    The main file, then each `imports` pattern in order (globs sorted), recursively, each
    file once.  containerd 1.x (`mergeConfig`): top-level keys of a later file win, and
    `plugins` entries are replaced *per plugin key* - a drop-in that names the CRI plugin
    replaces the whole CRI section of earlier files (containerd #5837).  2.x merges
    plugin tables deeply (containerd PR #9982, in v2.0.0).
    Returns (effective, files in merge order, {file: parsed}).
    """
    order: list[str] = []
    parsed: dict[str, dict[str, Any]] = {}

    def visit(path: str) -> None:
        if path in parsed:
            return
        text = root.read(path)
        if text is None:
            if path == conf:
                parsed[path] = {}
                order.append(path)
            return
        doc = _toml(text, path)
        parsed[path] = doc
        order.append(path)
        for pattern in _import_patterns(doc, path, relative_to_cwd):
            for p in root.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]:
                visit(p)

    visit(conf)
    eff: dict[str, Any] = {}
    for path in order:
        doc = copy.deepcopy(parsed[path])
        doc.pop("imports", None)
        if major >= 2:
            _deep_merge(eff, migrate_to_v3(doc))
            continue
        plugins = doc.pop("plugins", None)
        _deep_merge(eff, doc)  # mergo.Merge(WithOverride) for the rest of the struct
        if isinstance(plugins, dict):
            eff.setdefault("plugins", {}).update(plugins)
    if order:
        eff["version"] = parsed[order[0]].get("version", 1)
    return eff, order, parsed


def _containerd_bin(root: Root, explicit: str | None) -> str:
    if explicit:
        return explicit if root.exists(explicit) else ""
    for cand in ("/usr/bin/containerd", "/usr/local/bin/containerd", "/bin/containerd"):
        if root.exists(cand):
            return cand
    return ""


def containerd_version(root: Root, exe: str) -> str:
    if not exe:
        return ""
    r = root.run(exe, "--version")
    if r is None or r.returncode != 0:
        return ""
    # "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3" / "... v2.0.0 <sha>"
    for word in r.stdout.split()[2:3] or r.stdout.split():
        w = word.lstrip("v")
        if w[:1].isdigit():
            return w.split("~")[0].split("-")[0].split("+")[0]
    return ""


def config_dump(root: Root, exe: str, conf: str) -> tuple[dict[str, Any] | None, str]:
    """`containerd --config <conf> config dump` (chrooted when needed), or (None, why)."""
    if not exe:
        return None, "no containerd binary"
    r = root.run(exe, "--config", conf, "config", "dump")
    if r is None:
        return None, f"could not run {exe}"
    if r.returncode != 0:
        return None, f"`containerd config dump` failed: {r.stderr.strip()[-300:]}"
    try:
        return _loads(r.stdout), ""
    except _TOMLError as e:
        return None, f"`containerd config dump` printed unparsable TOML: {e}"


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


# ---- toolkit ------------------------------------------------------------------


def _wrapper_config(root: Root, binary: str) -> str:
    """NVIDIA_CTK_CONFIG_FILE_PATH set by a shell wrapper (the operator installs these)."""
    try:
        with open(root.fs(binary), "rb") as f:
            head = f.read(16384)
    except OSError:
        return ""
    if not head.startswith(b"#!"):
        return ""
    for line in head.decode("utf-8", "replace").splitlines():
        i = line.find("NVIDIA_CTK_CONFIG_FILE_PATH=")
        if i < 0:
            continue
        v = line[i + len("NVIDIA_CTK_CONFIG_FILE_PATH=") :].strip().split()[0] if line[i:].strip() else ""
        v = v.strip("'\"")
        if v.startswith("/") and "$" not in v:
            return v
    return ""


def toolkit_config_path(root: Root, binary: str) -> str:
    """Which config.toml the runtime at `binary` reads (host path)."""
    if binary:
        wrapped = _wrapper_config(root, binary)
        if wrapped:
            return wrapped
        if binary.startswith(OPERATOR_TOOLKIT + "/"):
            return OPERATOR_TOOLKIT_CONFIG
        beside = _beside(binary)
        if root.exists(beside):
            return beside
    return HOST_TOOLKIT_CONFIG


def _beside(binary: str) -> str:
    """The operator installer's layout: <toolkit dir>/.config/nvidia-container-runtime/config.toml."""
    return os.path.join(os.path.dirname(binary), ".config", "nvidia-container-runtime", "config.toml")


def read_toolkit(root: Root, path: str) -> ToolkitConfig:
    tk = ToolkitConfig(path=path)
    try:
        text = root.read(path)
    except DetectError as e:
        tk.error = str(e)
        return tk
    if text is None:
        return tk
    tk.exists = True
    try:
        doc = _loads(text)
    except _TOMLError as e:
        tk.error = f"cannot parse {path}: {e}"
        return tk
    rt = doc.get("nvidia-container-runtime") or {}
    cdi = _get(rt, "modes", "cdi") or {}

    def strs(v: Any, default: list[str]) -> list[str]:
        return [x for x in v if isinstance(x, str)] if isinstance(v, list) else default

    if isinstance(rt.get("mode"), str):
        tk.mode = rt["mode"]
    tk.runtimes = strs(rt.get("runtimes"), tk.runtimes)
    if isinstance(cdi.get("default-kind"), str):
        tk.default_kind = cdi["default-kind"]
    tk.annotation_prefixes = strs(cdi.get("annotation-prefixes"), tk.annotation_prefixes)
    tk.spec_dirs = strs(cdi.get("spec-dirs"), tk.spec_dirs)
    v = doc.get("accept-nvidia-visible-devices-envvar-when-unprivileged")
    if isinstance(v, bool):
        tk.accept_envvar_unprivileged = v
    v = doc.get("accept-nvidia-visible-devices-as-volume-mounts")
    if isinstance(v, bool):
        tk.accept_volume_mounts = v
    if isinstance(doc.get("swarm-resource"), str):
        tk.swarm_resource = doc["swarm-resource"]
    hook = doc.get("nvidia-container-runtime-hook") or {}
    if isinstance(hook, dict) and isinstance(hook.get("skip-mode-detection"), bool):
        tk.skip_mode_detection = hook["skip-mode-detection"]
    return tk


def toolkit_version(root: Root, binary: str) -> str:
    """`nvidia-ctk --version` next to the runtime or in /usr/bin ("" when absent)."""
    for exe in (os.path.join(os.path.dirname(binary), "nvidia-ctk") if binary else "", "/usr/bin/nvidia-ctk"):
        if exe and root.exists(exe):
            r = root.run(exe, "--version", timeout=10)
            if r is not None and r.returncode == 0:
                for word in r.stdout.replace(",", " ").split():
                    w = word.lstrip("v")
                    if w[:1].isdigit() and "." in w:
                        return w
    return ""


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for p in v.split("."):
        digits = "".join(c for c in p if c.isdigit()) if p else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


# ---- CDI ----------------------------------------------------------------------


def _yaml_scan(text: str) -> tuple[str, list[str]]:
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
    out = []
    seen = set()
    for d in dirs:
        for path in root.glob(os.path.join(d, "*")):
            if path in seen or not path.endswith((".json", ".yaml", ".yml")):
                continue
            seen.add(path)
            spec = CDISpec(path=path)
            try:
                text = root.read(path) or ""
            except DetectError as e:
                spec.error = str(e)
                out.append(spec)
                continue
            if path.endswith(".json"):
                try:
                    doc = json.loads(text)
                    spec.kind = str(doc.get("kind", ""))
                    spec.devices = [str(x.get("name", "")) for x in doc.get("devices") or [] if isinstance(x, dict)]
                except (ValueError, AttributeError) as e:
                    spec.error = f"invalid JSON: {e}"
            else:
                spec.kind, spec.devices = _yaml_scan(text)
            if not spec.kind and not spec.error:
                spec.error = "no kind"
            out.append(spec)
    return out


# ---- detection ----------------------------------------------------------------


def _is_nvidia(name: str, binary: str) -> bool:
    base = os.path.basename(binary)
    return name.startswith("nvidia") or any(base.startswith(b) for b in NVIDIA_BINARIES)


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _handlers(root: Root, ctd: dict[str, Any], raw_ctd: dict[str, Any] | None) -> list[Handler]:
    out = []
    runtimes: dict[str, Any] = _dict(ctd.get("runtimes"))
    raw_rts: dict[str, Any] = _dict(raw_ctd.get("runtimes")) if raw_ctd else {}
    for name, t in sorted(runtimes.items()):
        if not isinstance(t, dict):
            continue
        # The table as the admin/toolkit wrote it where the files have it (a dump adds every default).
        raw = raw_rts.get(name)
        table: dict[str, Any] = raw if isinstance(raw, dict) else t
        opts = _dict(t.get("options"))
        binary = str(opts.get("BinaryName") or "")
        ann = t.get("container_annotations")
        out.append(
            Handler(
                name=name,
                runtime_type=str(t.get("runtime_type") or ""),
                binary_name=binary,
                base_runtime_spec=str(t.get("base_runtime_spec") or ""),
                container_annotations=[a for a in ann if isinstance(a, str)] if isinstance(ann, list) else [],
                nvidia=_is_nvidia(name, binary),
                binary_exists=root.exists(binary) if binary.startswith("/") else bool(binary),
                table=copy.deepcopy(table),
            )
        )
    return out


def _pick_nvidia(handlers: list[Handler], default: str, exclude: str) -> Handler | None:
    """The handler install copies: the default if it is NVIDIA's, else `nvidia`, else another nvidia*."""
    nv = [h for h in handlers if h.nvidia and h.name != exclude and not is_vgpu_table(h.table)]
    for pick in (
        lambda h: h.name == default,
        lambda h: h.name == "nvidia",
        lambda h: not h.binary_name.endswith((".cdi", ".legacy")),
        lambda h: True,
    ):
        for h in nv:
            if pick(h):
                return h
    return None


def is_vgpu_table(table: dict[str, Any]) -> bool:
    ann = table.get("container_annotations")
    return isinstance(ann, list) and "vgpu.k8s.io/*" in ann


def detect(
    containerd_config: str = "/etc/containerd/config.toml",
    *,
    root: str = "/",
    containerd_bin: str | None = None,
    toolkit_config: str | None = None,
    major: int | None = None,
    use_dump: bool = True,
    exclude: str = "vgpu",
) -> NodeFacts:
    """Everything install and doctor need to know about this node (see the module doc)."""
    r = Root(root)
    conf = os.path.abspath(containerd_config) if containerd_config.startswith("/") else containerd_config
    facts = NodeFacts(root=r.root, containerd_config=conf)
    facts.config_exists = r.exists(conf)
    exe = _containerd_bin(r, containerd_bin)
    facts.containerd_bin = exe
    facts.containerd_version = containerd_version(r, exe)
    text = r.read(conf)
    main_doc = _toml(text, conf) if text else {}
    version = main_doc.get("version", 1) if text else 2
    if not isinstance(version, int) or isinstance(version, bool) or version not in CONFIG_VERSIONS:
        raise DetectError(f"{conf}: unsupported config version {version!r} (expected 1, 2, 3 or 4)")
    facts.config_version = version
    if major is None:
        if facts.config_version >= 3:
            major = 2
        elif facts.containerd_version:
            major = 2 if facts.containerd_version.startswith("2") else 1
        else:
            major = 1
    facts.containerd_major = major
    # 2.x migrates older files: its CRI runtime plugin is io.containerd.cri.v1.runtime either way
    facts.cri_plugin = V3_RUNTIME if major >= 2 else cri_plugin_name(facts.config_version)
    ver = _version_tuple(facts.containerd_version)
    old = major == 1 and bool(ver) and ver[:2] <= (1, 6)  # unknown 1.x: resolved as 1.7 does
    files_eff, order, parsed = load_files(r, conf, major, relative_to_cwd=old)
    facts.files = order
    eff: dict[str, Any] | None = None
    bin_major = int(facts.containerd_version[0]) if facts.containerd_version[:1].isdigit() else None
    if use_dump and facts.config_exists and bin_major is not None and bin_major != major:
        facts.source_note = f"containerd {facts.containerd_version} is not the {major}.x this config is for"
    elif use_dump and facts.config_exists:
        eff, why = config_dump(r, exe, conf)
        if eff is not None:
            facts.source = "config dump"
        else:
            facts.source_note = why
    elif not facts.config_exists:
        facts.source_note = f"{conf} does not exist"
    if eff is None:
        eff = files_eff
    cri = facts.cri_plugin
    # 1.x: the last file in merge order that has the CRI plugin owns the whole section.
    for path in reversed(order):
        if isinstance(_get(parsed[path], "plugins", cri), dict):
            facts.cri_file = path
            break
    cri_sec = _dict(_get(eff, "plugins", cri))
    ctd = _dict(cri_sec.get("containerd"))
    raw_ctd = _get(files_eff, "plugins", cri, "containerd")
    facts.default_runtime = str(ctd.get("default_runtime_name") or "runc")
    if facts.config_exists:
        facts.cri_error = cri_load_error(major, ctd)
    facts.handlers = _handlers(r, ctd, raw_ctd if isinstance(raw_ctd, dict) else None)
    cdi_default = major >= 2
    facts.cdi_enabled = bool(cri_sec.get("enable_cdi", cdi_default))
    file_cri = _get(files_eff, "plugins", cri)
    if facts.source == "config dump" and isinstance(file_cri, dict) and "enable_cdi" in file_cri:
        if "enable_cdi" not in cri_sec:
            facts.notes.append(
                f"containerd {facts.containerd_version or major} ignores enable_cdi (CDI in containerd needs >= 1.7)"
            )
    dirs = cri_sec.get("cdi_spec_dirs")
    facts.cdi_spec_dirs = [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else list(DEFAULT_CDI_DIRS)

    nv = _pick_nvidia(facts.handlers, facts.default_runtime, exclude)
    spec_dirs = list(facts.cdi_spec_dirs)
    if nv is not None:
        facts.nvidia_handler = nv.name
        legacy = nv.binary_name + ".legacy" if nv.binary_name and not nv.binary_name.endswith(".legacy") else ""
        if nv.binary_name.endswith(".cdi"):
            legacy = nv.binary_name[: -len(".cdi")] + ".legacy"
        if legacy and r.exists(legacy):
            facts.legacy_binary = legacy
        tk = read_toolkit(r, toolkit_config or toolkit_config_path(r, nv.binary_name))
        facts.toolkit = tk
        facts.toolkit_version = toolkit_version(r, nv.binary_name)
        spec_dirs += [d for d in tk.spec_dirs if d not in spec_dirs]
        if not nv.binary_exists:
            facts.notes.append(f"handler `{nv.name}`: BinaryName {nv.binary_name or '(none)'} does not exist")
        facts.node_type = _node_type(facts, nv, tk, parsed)
    elif toolkit_config:
        facts.toolkit = read_toolkit(r, toolkit_config)
    facts.cdi_specs = read_cdi_specs(r, spec_dirs)
    return facts


def runtime_mode(binary: str, tk: ToolkitConfig | None) -> str:
    """The mode a runtime binary runs in: `.cdi` / `.legacy` force it (cmd/nvidia-container-
    runtime.{cdi,legacy}/main.go: WithModeOverride), else the toolkit config's."""
    if binary.endswith(".cdi"):
        return "cdi"
    if binary.endswith(".legacy"):
        return "legacy"
    return tk.mode if tk is not None else "auto"


def _node_type(facts: NodeFacts, nv: Handler, tk: ToolkitConfig, parsed: dict[str, dict[str, Any]]) -> NodeType:
    mode = runtime_mode(nv.binary_name, tk)
    operator = nv.binary_name.startswith(OPERATOR_TOOLKIT + "/") or tk.path == _beside(nv.binary_name)
    if mode == "cdi":
        return "N3" if operator else "N1-cdi"
    if operator:
        return "N2"  # the GPU Operator's toolkit (wrappers + config under its toolkit dir)
    if mode == "legacy":
        return "N1-legacy"
    if mode == "jit-cdi":
        return "N1-jit-cdi"
    # `auto`: <= 1.17 resolves to legacy, >= 1.18 to jit-cdi (internal/info/auto.go).  Without
    # `nvidia-ctk --version`, the 1.18 drop-in (conf.d/99-nvidia.toml) is the tell.
    if facts.toolkit_version:
        return "N1-jit-cdi" if _version_tuple(facts.toolkit_version) >= (1, 18) else "N1-legacy"
    if any(os.path.basename(p) == "99-nvidia.toml" for p in parsed):
        return "N1-jit-cdi"
    return "N1-legacy"


def cri_fix(facts: NodeFacts) -> str:
    """What to do about `facts.cri_error` (one line)."""
    names = [h.name for h in facts.handlers]
    missing = facts.default_runtime
    if facts.containerd_major == 1 and facts.cri_file and facts.cri_file != facts.containerd_config:
        where = (
            f"{facts.cri_file} replaces the whole CRI section of the files before it on containerd 1.x and "
            f"defines only {', '.join(names) or 'no runtime'}"
        )
    else:
        where = f"the effective config defines only {', '.join(names) or 'no runtime'}"
    table = f'[plugins."{facts.cri_plugin}".containerd.runtimes.{missing}] runtime_type = "io.containerd.runc.v2"'
    return (
        f"{where}: add {table} to {facts.cri_file or facts.containerd_config} (or regenerate "
        f"{facts.containerd_config} with `containerd config default` and re-run `nvidia-ctk runtime configure "
        f"--runtime=containerd`), then restart containerd"
    )


def to_json(facts: NodeFacts) -> str:
    return msgspec.json.encode(facts).decode() + "\n"


def summary(facts: NodeFacts) -> list[str]:
    """Human lines: node type and the facts behind it."""
    lines = [f"node type: {facts.node_type}"]
    ver = facts.containerd_version or "unknown"
    lines.append(
        f"containerd {ver} (config version {facts.config_version}, CRI plugin {facts.cri_plugin}), "
        f"effective config from {facts.source}" + (f" ({facts.source_note})" if facts.source_note else "")
    )
    if facts.files:
        lines.append("config files in merge order: " + ", ".join(facts.files))
    if facts.cri_file and facts.containerd_major == 1:
        lines.append(f"CRI section owned by: {facts.cri_file}")
    lines.append(f"default runtime: {facts.default_runtime}")
    for h in facts.handlers:
        if h.nvidia or h.name == facts.default_runtime:
            miss = "" if h.binary_exists or not h.binary_name else " (missing)"
            lines.append(f"handler {h.name}: BinaryName={h.binary_name or '-'}{miss}")
    tk = facts.toolkit
    if tk is not None:
        state = "" if tk.exists else " (absent: defaults)"
        lines.append(
            f"toolkit config {tk.path}{state}: mode={tk.mode} default-kind={tk.default_kind} "
            f"accept-envvar-when-unprivileged={str(tk.accept_envvar_unprivileged).lower()} "
            f"accept-volume-mounts={str(tk.accept_volume_mounts).lower()} "
            f"annotation-prefixes={','.join(tk.annotation_prefixes)} spec-dirs={','.join(tk.spec_dirs)}"
        )
        if tk.error:
            lines.append(f"toolkit config error: {tk.error}")
    if tk is not None and tk.skip_mode_detection:
        lines.append("toolkit config: nvidia-container-runtime-hook.skip-mode-detection = true")
    if facts.legacy_binary:
        lines.append(f"legacy-mode runtime: {facts.legacy_binary}")
    if facts.cri_error:
        lines.append(f"CRI plugin will NOT load: {facts.cri_error}")
    lines.append(
        f"CDI: {'enabled' if facts.cdi_enabled else 'disabled'} in containerd, "
        f"{len(facts.cdi_specs)} spec(s)"
        + "".join(f"; {s.path} ({s.kind}: {len(s.devices)} devices)" for s in facts.cdi_specs)
    )
    lines.extend(f"note: {n}" for n in facts.notes)
    return lines
