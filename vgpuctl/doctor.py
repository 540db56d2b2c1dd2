"""`vgpuctl doctor`: the node preflight an operator runs first.

Prints the node type (node_setup.nodetype) and, per check, OK / WARN / FAIL with the
fix: containerd and the effective `vgpu` handler (does it reach the NVIDIA runtime? is our
base spec in it?), CDI state and specs, the toolkit's flags against the device plugin's
device-list strategy, the library and the hook (and a host Python >= 3.9 for it), NVML and
the GPUs, the kubelet's device-plugin dir and our socket, the monitor and its guardian.
`--json` for machines; the exit status is 1 when any check FAILs.  Needs no cluster and
works on a node with nothing installed (then it says what is missing).

Every host path is read under `root` (`--root DIR`: the host's / as a container sees it),
so tests run it against temporary trees; NVML is probed only when root is / (a library
loaded from another root would be the wrong one).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from node_setup.containerd.handler import uuid_named_kinds
from node_setup.containerd.plan import sidecar_path
from node_setup.nodetype import report
from node_setup.nodetype.detect import detect as detect_node
from node_setup.nodetype.facts import NVIDIA_BINARIES, NodeFacts
from node_setup.nodetype.root import DetectError, Root
from node_setup.nodetype.toolkit import runtime_mode
from vgpu.config import ConfigError, NodeConfig, config_path_from_env, load_config
from vgpuctl import migcheck

Status = Literal["OK", "WARN", "FAIL"]
STALE_S = 10.0
MIN_HOOK_PYTHON = (3, 9)
PYTHON_CANDIDATES = (
    "/usr/bin/python3",
    "/usr/local/bin/python3",
    "/usr/libexec/platform-python",
    "/opt/vgpu/bin/python",
)
NODE_TYPES = {
    "N1-legacy": "host NVIDIA Container Toolkit, runtime in legacy mode (toolkit <= 1.17 `auto`, or `legacy`)",
    "N1-jit-cdi": "host NVIDIA Container Toolkit >= 1.18, runtime in jit-cdi mode (`auto`)",
    "N1-cdi": "host NVIDIA Container Toolkit, runtime in cdi mode",
    "N2": "GPU Operator: toolkit under /usr/local/nvidia/toolkit, runtime in `auto` mode",
    "N3": "GPU Operator: toolkit under /usr/local/nvidia/toolkit, runtime in cdi mode",
    "none": "no NVIDIA container runtime",
}
HOOK_CHECKED_ENVS = {"NVIDIA_VISIBLE_DEVICES", "DOCKER_RESOURCE_GPU"}  # runtime_hook/oci.py: DEVICE_LIST_ENVS
INSTALL_TOOLKIT = (
    "install the NVIDIA Container Toolkit and run `nvidia-ctk runtime configure --runtime=containerd` "
    "(or deploy the GPU Operator), restart containerd, then `vgpu-hook containerd install`"
)
REINSTALL = "vgpu-hook containerd install && systemctl restart containerd"


class Check(msgspec.Struct, kw_only=True):
    name: str
    status: Status
    message: str
    fix: str = ""


class Report(msgspec.Struct, kw_only=True):
    node_type: str
    node_type_description: str
    root: str
    checks: list[Check]
    facts: NodeFacts | None = None

    @property
    def failed(self) -> bool:
        return any(c.status == "FAIL" for c in self.checks)


class Options(msgspec.Struct, kw_only=True):
    root: str = "/"
    config: str | None = None  # node config (host path); None: $VGPU_CONFIG or /etc/vgpu/config.toml
    containerd_config: str = "/etc/containerd/config.toml"
    containerd_bin: str | None = None
    toolkit_config: str | None = None
    handler: str = "vgpu"
    nvml: bool = True


NvmlProbe = Callable[[], list[tuple[str, str, int]]]  # [(uuid, name, memory_total)]; raises on failure
PythonProbe = Callable[[Root, str], tuple[int, int] | None]  # interpreter -> (major, minor) or None


def nvml_probe() -> list[tuple[str, str, int]]:
    from vgpu import nvml

    nvml.init(attempts=1)
    try:
        return [(g.uuid, g.name, g.memory_total) for g in nvml.inventory()]
    finally:
        nvml.shutdown()


def python_version(root: Root, python: str) -> tuple[int, int] | None:
    """(major, minor) of a host interpreter (run under chroot when root is not /), None if it does not run."""
    if not root.exists(python):
        return None
    r = root.run(python, "-I", "-S", "-c", "import sys; print(sys.version_info[0], sys.version_info[1])", timeout=20)
    if r is None or r.returncode != 0:
        return None
    try:
        major, minor = (int(x) for x in r.stdout.split()[:2])
    except ValueError:
        return None
    return major, minor


def find_hook_python(
    root: Root, preferred: str = "", probe: PythonProbe = python_version
) -> tuple[str, tuple[int, int] | None]:
    """The interpreter the hook runs with (the installed one, else the first candidate >= 3.9)."""
    for cand in ([preferred] if preferred else []) + list(PYTHON_CANDIDATES):
        v = probe(root, cand)
        if v is not None and (v >= MIN_HOOK_PYTHON or cand == preferred):
            return cand, v
    return (preferred, None) if preferred else ("", None)


def _hook_of(spec: dict[str, Any]) -> tuple[str, str, dict[str, str]]:
    """(python, fastpath.py, flags) of our prestart hook in a base spec ("" when absent)."""
    for h in (spec.get("hooks") or {}).get("prestart") or []:
        args = h.get("args") if isinstance(h, dict) else None
        if not isinstance(args, list):
            continue
        for i, a in enumerate(args):
            if isinstance(a, str) and a.endswith("/fastpath.py") and i >= 1:
                flags = {}
                rest = [x for x in args[i + 1 :] if isinstance(x, str)]
                for j in range(0, len(rest) - 1):
                    if rest[j].startswith("--"):
                        flags[rest[j]] = rest[j + 1]
                return str(args[i - 1 - (2 if args[i - 1] == "-S" else 0)]), a, flags
    return "", "", {}


def _sidecar(root: Root, conf: str) -> dict[str, Any]:
    try:
        text = root.read(sidecar_path(conf))
        d = json.loads(text) if text else {}
    except (DetectError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


class Doctor:
    def __init__(
        self,
        opts: Options,
        nvml: NvmlProbe | None = None,
        python: PythonProbe = python_version,
        now: float = 0,
        mig: migcheck.MigProbe | None = None,
    ) -> None:
        self.opts = opts
        self.root = Root(opts.root)
        self.nvml = nvml or nvml_probe
        self.mig = mig or migcheck.mig_probe
        self.python = python
        self.now = now or time.time()
        self.checks: list[Check] = []
        self.cfg = NodeConfig()
        self.facts: NodeFacts | None = None

    def add(self, name: str, status: Status, message: str, fix: str = "") -> None:
        self.checks.append(Check(name=name, status=status, message=message, fix=fix))

    # -- the checks, in the order they print --

    def run(self) -> Report:
        self.check_config()
        self.check_containerd()
        if self.facts is not None:
            self.check_node_type(self.facts)
            spec = self.check_handler(self.facts)
            self.check_cdi(self.facts)
            self.check_toolkit_flags(self.facts)
            self.check_hook(spec)
        if self.check_nvml():
            self.check_mig()
        self.check_device_plugin()
        self.check_monitor()
        nt = self.facts.node_type if self.facts else "none"
        return Report(
            node_type=nt,
            node_type_description=NODE_TYPES.get(nt, ""),
            root=self.root.root,
            checks=self.checks,
            facts=self.facts,
        )

    def check_config(self) -> None:
        path = self.opts.config or config_path_from_env()
        real = self.root.fs(path)
        if not os.path.exists(real):
            self.add("config", "OK", f"no {path}: built-in defaults (state dir {self.cfg.common.state_dir})")
            return
        try:
            self.cfg = load_config(real)
        except ConfigError as e:
            self.add("config", "FAIL", str(e).replace(real, path), f"fix {path} (docs/design.md lists every key)")
            return
        self.add("config", "OK", f"{path} (state dir {self.cfg.common.state_dir})")

    def check_containerd(self) -> None:
        o = self.opts
        try:
            f = detect_node(
                o.containerd_config,
                root=o.root,
                containerd_bin=o.containerd_bin,
                toolkit_config=o.toolkit_config,
                exclude=o.handler,
            )
        except DetectError as e:
            self.add("containerd", "FAIL", str(e), f"fix the containerd configuration ({o.containerd_config})")
            return
        self.facts = f
        if not f.containerd_bin:
            self.add(
                "containerd",
                "FAIL",
                "containerd not found",
                "install containerd (Debian: apt-get install containerd)",
            )
        elif not f.config_exists:
            self.add(
                "containerd",
                "WARN",
                f"containerd {f.containerd_version or '?'}; {o.containerd_config} absent (built-in defaults)",
                f"containerd config default > {o.containerd_config}, then configure the NVIDIA runtime",
            )
        elif f.cri_error:
            self.add("containerd", "FAIL", f"containerd's CRI plugin will not load: {f.cri_error} (no pod can start)",
                     report.cri_fix(f))  # fmt: skip
        else:
            where = f"effective config from {f.source}" + (f" ({f.source_note})" if f.source_note else "")
            version = f.containerd_version or "(version unknown)"
            self.add("containerd", "OK", f"containerd {version}, {o.containerd_config}, {where}")

    def check_node_type(self, f: NodeFacts) -> None:
        side = _sidecar(self.root, f.containerd_config)
        if f.node_type == "none":
            if side.get("without_nvidia_runtime"):
                self.add("node-type", "WARN", "no NVIDIA container runtime (installed with --without-nvidia-runtime)",
                         "on a GPU node: " + INSTALL_TOOLKIT)  # fmt: skip
            else:
                self.add("node-type", "FAIL", "no NVIDIA container runtime handler in containerd", INSTALL_TOOLKIT)
            return
        nv = f.handler(f.nvidia_handler)
        desc = f"{f.node_type}: {NODE_TYPES[f.node_type]}; handler `{f.nvidia_handler}`"
        if nv is not None and nv.binary_name and not nv.binary_exists:
            self.add("node-type", "FAIL", f"{desc} names {nv.binary_name}, which does not exist",
                     "reinstall the NVIDIA Container Toolkit (or re-run its configure step)")  # fmt: skip
            return
        self.add("node-type", "OK", desc + (f" -> {nv.binary_name}" if nv is not None else ""))

    def check_handler(self, f: NodeFacts) -> dict[str, Any] | None:
        """The `vgpu-handler` check, then `vgpu-base-spec` (returns our base spec, when readable)."""
        start = len(self.checks)
        spec = self._check_handler(f)
        handler = [c for c in self.checks[start:] if c.name == "vgpu-handler"]
        rest = [c for c in self.checks[start:] if c.name != "vgpu-handler"]
        self.checks[start:] = handler + rest
        return spec

    def _check_handler(self, f: NodeFacts) -> dict[str, Any] | None:
        name = self.opts.handler
        h = f.handler(name)
        if h is None:
            self.add("vgpu-handler", "FAIL", f"no runtime handler `{name}` in containerd's effective config", REINSTALL)
            return None
        problems: list[str] = []
        side = _sidecar(self.root, f.containerd_config)
        reaches = any(os.path.basename(h.binary_name).startswith(b) for b in NVIDIA_BINARIES)
        status: Status = "OK"
        if not reaches:
            msg = f"handler `{name}` runs {h.binary_name or 'runc'}: containers get no GPU from NVIDIA's runtime"
            if side.get("without_nvidia_runtime") and f.node_type == "none":
                self.add("vgpu-handler", "WARN", msg + " (installed with --without-nvidia-runtime)")
            else:
                fix = REINSTALL + " (the handler is then a copy of the NVIDIA handler)"
                self.add("vgpu-handler", "FAIL", msg, fix if f.node_type != "none" else INSTALL_TOOLKIT)
                status = "FAIL"
        elif not h.binary_exists:
            self.add("vgpu-handler", "FAIL", f"handler `{name}`: BinaryName {h.binary_name} does not exist", REINSTALL)
            status = "FAIL"
        if "vgpu.k8s.io/*" not in h.container_annotations:
            problems.append("container_annotations lacks vgpu.k8s.io/* (the token never reaches the hook)")
        spec: dict[str, Any] | None = None
        if not h.base_runtime_spec:
            problems.append("no base_runtime_spec (our hooks never run)")
        else:
            try:
                text = self.root.read(h.base_runtime_spec)
                spec = json.loads(text) if text is not None else None
            except (DetectError, ValueError) as e:
                problems.append(f"base_runtime_spec {h.base_runtime_spec}: {e}")
            if spec is None and not problems:
                problems.append(f"base_runtime_spec {h.base_runtime_spec} does not exist")
            elif isinstance(spec, dict) and not _hook_of(spec)[1]:
                problems.append(f"base_runtime_spec {h.base_runtime_spec} has no vgpu-hook prestart hook")
        if problems:
            self.add("vgpu-base-spec", "FAIL", f"handler `{name}`: " + "; ".join(problems), REINSTALL)
        else:
            self.add("vgpu-base-spec", "OK", f"handler `{name}`: base spec {h.base_runtime_spec} with our hooks")
        if status == "OK" and reaches:
            problem = self._strategy_problem(f, h.binary_name)
            if problem:
                self.add("vgpu-handler", "FAIL", f"handler `{name}` runs {h.binary_name}: {problem[0]}", problem[1])
                return spec
            mode = runtime_mode(h.binary_name, f.toolkit)
            self.add(
                "vgpu-handler", "OK", f"handler `{name}` reaches the NVIDIA runtime: {h.binary_name} ({mode} mode)"
            )
        return spec

    def _strategy_problem(self, f: NodeFacts, binary: str) -> tuple[str, str] | None:
        """(problem, fix) when the vgpu handler's NVIDIA runtime cannot give a container the GPUs
        the device plugin names, in the mode it runs (docs/operators/install.md), else None.

        - `.legacy`: its hook reads the toolkit config and refuses unless the mode resolves to
          legacy or skip-mode-detection (hook_config.go@v1.20.0: assertModeIsLegacy);
        - envvar / volume-mounts name bare UUIDs: in cdi mode they become <default-kind>=<uuid>
          (modifier/cdi.go: cdiDeviceRequestor), which a CDI spec must define; other modes take
          them as they are;
        - cdi-annotations: read by the runtime in cdi mode (and in auto mode, which is cdi when
          every request is a CDI name, info/auto.go) under its annotation-prefixes, and by
          containerd >= 1.7 itself where CDI is enabled (internal/cri/opts/spec_linux.go: WithCDI);
          in legacy and jit-cdi mode the runtime clears the prefixes (runtime_factory.go);
        - cdi-cri: containerd's CDI only (the `cdi` check)."""
        tk = f.toolkit
        if tk is None:
            return None
        mode = runtime_mode(binary, tk)
        if binary.endswith(".legacy") and not tk.legacy_hook_accepts():
            return (
                f"its legacy hook refuses every GPU container: {tk.path} is in {tk.mode} mode with "
                'skip-mode-detection = false ("invoking the NVIDIA Container Runtime Hook directly ... is not '
                'supported")',
                f"{REINSTALL} (install keeps the runtime in {tk.mode} mode), or set "
                f"[nvidia-container-runtime-hook] skip-mode-detection = true in {tk.path}",
            )
        dp = self.cfg.device_plugin
        strategies = list(getattr(dp, "device_list_strategy", ["envvar"]))
        prefix = str(getattr(dp, "cdi_annotation_prefix", "cdi.k8s.io/"))
        why: list[str] = []
        for st in strategies:
            if st in ("envvar", "volume-mounts"):
                if mode != "cdi" or tk.default_kind in uuid_named_kinds(f):
                    return None
                why.append(f"{st}: bare UUIDs become {tk.default_kind}=<uuid>, which no CDI spec defines")
            elif st == "cdi-annotations":
                honoured = mode in ("cdi", "auto") and any(prefix.startswith(p) for p in tk.annotation_prefixes)
                if honoured or f.cdi_enabled:
                    return None
                if mode in ("cdi", "auto"):
                    read = ", ".join(tk.annotation_prefixes)
                    why.append(f"cdi-annotations: the runtime reads annotations under {read}, not {prefix}")
                else:
                    ver = f.containerd_version or str(f.containerd_major)
                    why.append(f"cdi-annotations: the runtime in {mode} mode ignores CDI annotations and containerd "
                               f"{ver} has no CDI enabled: pods get their limits but no GPU")  # fmt: skip
            else:
                return None  # cdi-cri: the `cdi` check
        if not why:
            return None
        fix = (
            'device_plugin.device_list_strategy = ["cdi-annotations"] with a cdi_kind whose spec names the GPUs by '
            "UUID, or generate one: nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"
            if mode == "cdi"
            else 'device_plugin.device_list_strategy = ["envvar"] (the runtime\'s '
            f"{mode} mode takes NVIDIA_VISIBLE_DEVICES), or enable CDI in containerd >= 1.7 (enable_cdi = true)"
        )
        return "; ".join(why), fix

    def check_cdi(self, f: NodeFacts) -> None:
        kinds = sorted({s.kind for s in f.cdi_specs if s.kind})
        bad = [s for s in f.cdi_specs if s.error]
        state = "enabled" if f.cdi_enabled else "disabled"
        msg = f"CDI {state} in containerd; {len(f.cdi_specs)} spec(s)" + (f": {', '.join(kinds)}" if kinds else "")
        strategies = set(getattr(self.cfg.device_plugin, "device_list_strategy", ["envvar"]))
        want = getattr(self.cfg.device_plugin, "cdi_kind", "nvidia.com/gpu")
        if bad:
            self.add("cdi", "WARN", msg + "; unreadable: " + ", ".join(f"{s.path} ({s.error})" for s in bad),
                     "fix or remove those files (`nvidia-ctk cdi generate` rewrites NVIDIA's)")  # fmt: skip
        elif strategies & {"cdi-annotations", "cdi-cri"} and want not in kinds:
            self.add("cdi", "FAIL", msg + f"; the device plugin names CDI devices of kind {want}, no spec has it",
                     f"nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml (kind {want})")  # fmt: skip
        elif "cdi-cri" in strategies and not f.cdi_enabled:
            self.add("cdi", "FAIL", msg + "; cdi-cri needs containerd's CDI (enable_cdi, containerd >= 1.7.2)",
                     "set enable_cdi = true in the CRI plugin section and restart containerd")  # fmt: skip
        else:
            self.add("cdi", "OK", msg)

    def check_toolkit_flags(self, f: NodeFacts) -> None:
        tk = f.toolkit
        if tk is None:
            return
        strategies = set(getattr(self.cfg.device_plugin, "device_list_strategy", ["envvar"]))
        where = tk.path + ("" if tk.exists else " (absent: NVIDIA's defaults)")
        if tk.error:
            self.add("toolkit", "FAIL", tk.error, f"fix {tk.path}")
            return
        swarm = {e.strip() for e in tk.swarm_resource.split(",") if e.strip()}
        if swarm - HOOK_CHECKED_ENVS:
            self.add("toolkit", "FAIL", f"{where}: swarm-resource = {tk.swarm_resource!r}: containers may pick GPUs "
                     f"through {', '.join(sorted(swarm - HOOK_CHECKED_ENVS))}, which vgpu-hook does not check",
                     f"remove swarm-resource from {tk.path} (Kubernetes nodes do not use it)")  # fmt: skip
            return
        if "volume-mounts" in strategies and not tk.accept_volume_mounts:
            self.add("toolkit", "FAIL", f"{where}: accept-nvidia-visible-devices-as-volume-mounts is false, but the "
                     "device plugin names GPUs by volume mounts: containers get no GPU",
                     f"set accept-nvidia-visible-devices-as-volume-mounts = true in {tk.path}")  # fmt: skip
        elif strategies == {"envvar"} and not tk.accept_envvar_unprivileged:
            self.add("toolkit", "FAIL", f"{where}: accept-nvidia-visible-devices-envvar-when-unprivileged is false, "
                     "but the device plugin names GPUs by NVIDIA_VISIBLE_DEVICES: unprivileged pods get no GPU",
                     "set device_plugin.device_list_strategy = [\"volume-mounts\"] and "
                     f"accept-nvidia-visible-devices-as-volume-mounts = true in {tk.path}")  # fmt: skip
        elif tk.accept_envvar_unprivileged:
            self.add("toolkit", "WARN", f"{where}: unprivileged containers may pick GPUs through their own "
                     "NVIDIA_VISIBLE_DEVICES (accept-nvidia-visible-devices-envvar-when-unprivileged = true; most "
                     "CUDA images set it to all)",
                     f"in {tk.path}: accept-nvidia-visible-devices-envvar-when-unprivileged = false and "
                     "accept-nvidia-visible-devices-as-volume-mounts = true; device_plugin.device_list_strategy = "
                     "[\"volume-mounts\"]")  # fmt: skip
        else:
            self.add("toolkit", "OK", f"{where}: mode {tk.mode}, GPUs only through the device plugin")

    def check_hook(self, spec: dict[str, Any] | None) -> None:
        python, fast, flags = _hook_of(spec) if spec else ("", "", {})
        lib = flags.get("--library-path") or self.cfg.hook.library_path
        if self.root.exists(lib):
            self.add("library", "OK", f"{lib}")
        else:
            self.add("library", "FAIL", f"{lib} does not exist (the library vGPU containers get)",
                     "install the k8s-vgpu package (it ships /usr/lib/vgpu/libvgpu.so) or set hook.library_path "
                     "and re-run vgpu-hook containerd install")  # fmt: skip
        if spec is not None:
            if fast and self.root.exists(fast):
                self.add("hook", "OK", f"{fast}")
            else:
                self.add("hook", "FAIL", f"the hook {fast or '(none)'} named in the base spec does not exist",
                         REINSTALL)  # fmt: skip
        found, ver = find_hook_python(self.root, python, self.python)
        if ver is not None and ver >= MIN_HOOK_PYTHON:
            self.add("hook-python", "OK", f"{found} is Python {ver[0]}.{ver[1]}")
        else:
            what = f"{found} is Python {ver[0]}.{ver[1]}" if ver else (f"{found} does not run" if found else "none")
            self.add("hook-python", "FAIL", f"the hook needs a host Python >= 3.9: {what}",
                     "install python3 (Debian/Ubuntu: apt-get install python3-minimal; RHEL/Fedora: dnf install "
                     "python3), or on nodes without a package manager (Flatcar, Bottlerocket, Talos) use the "
                     "interpreter the node installer ships under /usr/local/vgpu or the package's "
                     "/opt/vgpu/bin/python, "
                     "then `vgpu-hook containerd install --python <it>`")  # fmt: skip

    def check_nvml(self) -> bool:
        if not self.opts.nvml:
            return False
        if not self.root.is_host:
            self.add("nvml", "WARN", f"not probed under --root {self.root.root}", "run vgpuctl doctor on the host")
            return False
        try:
            gpus = self.nvml()
        except Exception as e:  # NVML errors, library not found, ...
            self.add("nvml", "FAIL", f"NVML not reachable: {e}",
                     "install the NVIDIA driver and load its kernel module (`nvidia-smi` must work)")  # fmt: skip
            return False
        if not gpus:
            self.add("nvml", "FAIL", "NVML works but reports no GPU", "check `nvidia-smi` and the driver")
            return False
        names = "; ".join(f"{u} {n} {m / (1 << 30):.0f} GiB" for u, n, m in gpus)
        self.add("nvml", "OK", f"{len(gpus)} GPU(s): {names}")
        return True

    def check_mig(self) -> None:
        """MIG modes, MIG devices and who uses them, the strategy (vgpuctl/migcheck.py)."""
        try:
            layout = self.mig()
        except Exception as e:  # NVML errors reading the MIG devices
            self.add("mig", "WARN", f"cannot read the MIG devices: {e}")
            return
        try:
            text = self.root.read(self.cfg.paths.status_path)
            status = json.loads(text) if text is not None else None
        except (DetectError, ValueError):
            status = None
        for st, msg, fix in migcheck.check(layout, self.cfg, status if isinstance(status, dict) else None):
            self.add("mig", st, msg, fix)  # type: ignore[arg-type]

    def check_device_plugin(self) -> None:
        dp = self.cfg.device_plugin
        d = os.path.join(dp.kubelet_dir, "device-plugins")
        sock = os.path.join(d, dp.socket_name)
        if not os.path.isdir(self.root.fs(d)):
            self.add("device-plugin", "WARN", f"{d} does not exist: no kubelet on this node (yet)",
                     "join the node to the cluster (kubelet creates it)")  # fmt: skip
            return
        kubelet = os.path.join(d, "kubelet.sock")
        try:
            ours = stat.S_ISSOCK(os.stat(self.root.fs(sock)).st_mode)
        except OSError:
            ours = False
        if not ours:
            self.add("device-plugin", "FAIL", f"no device-plugin socket {sock}: vgpu-device-plugin is not running",
                     "systemctl enable --now vgpu-device-plugin (or deploy the Helm chart's DaemonSet)")  # fmt: skip
            return
        k = "" if os.path.exists(self.root.fs(kubelet)) else " (no kubelet.sock: kubelet not running?)"
        self.add("device-plugin", "OK" if not k else "WARN", f"{sock}{k}")

    def check_monitor(self) -> None:
        path = self.cfg.paths.status_path
        try:
            text = self.root.read(path)
            status = json.loads(text) if text is not None else None
        except (DetectError, ValueError) as e:
            self.add("monitor", "FAIL", f"{path}: {e}", "systemctl restart vgpu-monitor")
            return
        if not isinstance(status, dict):
            self.add("monitor", "FAIL", f"no monitor status at {path}: vgpu-monitor is not running",
                     "systemctl enable --now vgpu-monitor (or deploy the Helm chart's DaemonSet)")  # fmt: skip
            return
        age = self.now - float(status.get("time", 0) or 0)
        if not status.get("running", True) or age > STALE_S:
            self.add("monitor", "FAIL", f"vgpu-monitor status is {age:.0f}s old (not running)",
                     "systemctl restart vgpu-monitor; journalctl -u vgpu-monitor")  # fmt: skip
            return
        self.add("monitor", "OK", f"pid {status.get('pid', '?')}, policy {status.get('policy', '?')}, "
                 f"updated {age:.1f}s ago")  # fmt: skip
        if status.get("guardian_armed"):
            self.add("guardian", "OK", "armed (suspended processes are resumed if the monitor dies)")
        else:
            self.add("guardian", "FAIL", "not armed: the monitor never suspends anything without it",
                     "journalctl -u vgpu-monitor (the guardian process failed to start)")  # fmt: skip


def render(report: Report) -> str:
    lines = [f"node type: {report.node_type} ({report.node_type_description})"]
    if report.root != "/":
        lines[0] += f"  [root {report.root}]"
    width = max((len(c.name) for c in report.checks), default=8)
    for c in report.checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.message}")
        if c.fix and c.status != "OK":
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    n = {s: sum(1 for c in report.checks if c.status == s) for s in ("OK", "WARN", "FAIL")}
    lines.append(f"{n['OK']} OK, {n['WARN']} WARN, {n['FAIL']} FAIL")
    return "\n".join(lines) + "\n"


def add_arguments(p: Any) -> None:
    p.add_argument("--config", default=None, help="node config (default $VGPU_CONFIG, else /etc/vgpu/config.toml)")
    p.add_argument("--root", default="/", help="the host's / (check the files under it)")
    p.add_argument("--containerd-config", default="/etc/containerd/config.toml")
    p.add_argument("--containerd-bin", default=None, help="containerd for `config dump` (host path)")
    p.add_argument("--toolkit-config", default=None, help="the NVIDIA runtime's config.toml (default: detected)")
    p.add_argument("--handler", default="vgpu", help="our runtime handler name")
    p.add_argument("--no-nvml", action="store_true", help="skip the NVML probe")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def main(a: Any) -> int:
    opts = Options(
        root=a.root,
        config=a.config,
        containerd_config=a.containerd_config,
        containerd_bin=a.containerd_bin,
        toolkit_config=a.toolkit_config,
        handler=a.handler,
        nvml=not a.no_nvml,
    )
    report = Doctor(opts).run()
    if a.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        sys.stdout.write(render(report))
    return 1 if report.failed else 0
