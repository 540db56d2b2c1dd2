"""The demo scenario: the whole k8s-vgpu node stack on one GPU, step by step.

Used by `make demo` (packaging/demo/demo.py, which prints the report) and by the end-to-end
test (tests/e2e, which asserts on every step).  Each step is one method of `Demo`, returns
what it observed, and raises `StepFailed` with a one-line reason when the stack misbehaves.

1. `start_gpu`: the simulated driver with one 10 GiB GPU (sim/fakegpu), or the real GPU.
2. `start_plugin`: `vgpu-device-plugin` (split count 10) against the kubelet stand-in
   (sim/kubelet.py); `admit` allocates 3 vGPUs to pod-a and 7 to pod-b as the kubelet
   would: slices of 30 % and 70 % of memory, compute shares 30 % and 70 %.
3. `run_containers`: both pods' containers under runc, created through nvidia-container-runtime
   (the simulated toolkit's stand-in, sim/fakegpu/toolkit, or the real one on a GPU node) as
   containerd would, with the hooks `vgpu-hook containerd install` writes; what each gets is the
   device plugin's Allocate response (env, mounts, annotations: the GPU selection and the token),
   so the GPU arrives only through the NVIDIA runtime;
   `isolation` reads what each saw: cuMemGetInfo (fakegpu-burn) and pynvml report its slice, an
   allocation past the slice fails with CUDA_ERROR_OUT_OF_MEMORY, the other container's large
   allocation succeeds.
4. `compute`: both saturate the GPU; the split is measured without the monitor, then
   `vgpu-monitor` starts and each container is held to its share; `scrape` reads /metrics.
5. `report`: one table; `close` stops everything that was started (also on Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from vgpu_demo import containers as ctr

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 1 << 30
MiB = 1 << 20
RESOURCE = "nvidia.com/gpu"
SPLIT = 10
PODS = (("pod-a", 3), ("pod-b", 7))  # vGPUs per pod -> 30 % / 70 %
TOKEN_ENV = "VGPU_ALLOCATION_TOKEN"
TOKEN_ANNOTATION = "vgpu.k8s.io/allocation-token"
# Where the simulated toolkit puts the driver libraries: the rootfs bind-mounts the host's /usr/lib
# read-only, so not /usr/lib/x86_64-linux-gnu; the image's LD_LIBRARY_PATH names it, as CUDA
# images name /usr/local/nvidia/lib64.
CTR_LIB_DIR = "/usr/local/nvidia/lib64"
CTR_BURN = "/opt/demo/bin/fakegpu-burn"
CUDA_ERROR_OUT_OF_MEMORY = 2

NVML_QUERY = """
import json, sys
sys.path.insert(0, sys.argv[1])
import pynvml
pynvml.nvmlInit()
out = []
def row(h):
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    out.append({"uuid": pynvml.nvmlDeviceGetUUID(h), "total": m.total, "used": m.used, "free": m.free})
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    try:
        mig = pynvml.nvmlDeviceGetMigMode(h)[0] == 1
    except pynvml.NVMLError:
        mig = False
    if not mig:
        row(h)
        continue
    for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):  # a GPU in MIG mode: its MIG devices
        try:
            row(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j))
        except pynvml.NVMLError_NotFound:
            pass
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


class StepFailed(RuntimeError):
    """A step of the scenario did not do what it must; the message says what."""


@dataclass
class Pod:
    name: str
    vgpus: int
    token: str = ""
    uuid: str = ""
    memory_limit: int = 0
    core_percent: int = 0
    container: ctr.Container | None = None
    alloc: Any = None  # the kubelet's ContainerAllocation (sim/kubelet.py)
    seen: dict[str, Any] = field(default_factory=dict)  # what it reported in phase 1
    share_before: float = 0.0  # measured SM use without the monitor (percent)
    share_after: float = 0.0  # ... with the monitor
    metrics: dict[str, float] = field(default_factory=dict)


def _wait(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise StepFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


def real_gpu_present() -> bool:
    """An NVIDIA GPU with its driver: device nodes and a working nvidia-smi."""
    if not os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and "GPU " in r.stdout


class Demo:
    """The node stack of the demo; a context manager that cleans up whatever it started."""

    def __init__(
        self,
        build_dir: Path,
        *,
        real_gpu: bool = False,
        log: Callable[[str], None] = print,
        workdir: Path | None = None,
        burn_kernel_us: int = 100,
        device_list_strategy: str = "envvar",
        mig_profile: str = "",
        mig_dynamic: bool = False,
    ) -> None:
        # How Allocate names the GPU (device_plugin/strategy.py); the simulated toolkit is
        # configured as a node using it would be: volume-mounts with the secure pair of flags,
        # cdi-annotations with a CDI spec of the GPU in its spec dir.
        self.strategy = device_list_strategy
        # MIG (simulated only): the GPU is an H200 in MIG mode with one instance of this profile,
        # split by the plugin's `--mig-strategy vgpu` (docs/operators/mig.md)
        self.mig_profile = mig_profile
        # dynamic MIG (simulated only): an H200 in MIG mode without instances, the plugin's
        # `--mig-strategy dynamic` makes one per container the scheduler placed
        self.mig_dynamic = mig_dynamic
        self.gpu_uuid = ""
        self.build = Path(build_dir).resolve()
        self.real = real_gpu
        self.log = log
        self.kernel_us = burn_kernel_us
        self._own_workdir = workdir is None
        self.work = Path(workdir or tempfile.mkdtemp(prefix="vgpu-demo-"))
        self.state_dir = self.work / "state"
        self.runc_root = self.work / "runc"
        self.stack = contextlib.ExitStack()
        self.pods = [Pod(n, k) for n, k in PODS]
        self.env: dict[str, str] = {}
        self.gpu: Any = None  # sim.fakegpu.harness.FakeGPU (simulated mode)
        self.uuid = ""
        self.gpu_memory = 0
        self.kubelet: Any = None
        self.plugin: subprocess.Popen[bytes] | None = None
        self.monitor: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.metrics_text = ""

    # ---- life cycle -------------------------------------------------------------------------

    def __enter__(self) -> Demo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop containers, daemons, kubelet stand-in, simulator; remove the work directory."""
        with _no_interrupts():
            try:
                self.stack.close()
            finally:
                if self._own_workdir:
                    shutil.rmtree(self.work, ignore_errors=True)

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        logf = open(self.work / f"{name}.log", "wb")  # closed by the stack
        self.stack.callback(logf.close)
        p = subprocess.Popen(
            argv,
            env=self._daemon_env(),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            cwd=ROOT,
            start_new_session=True,
        )
        self.stack.callback(_terminate, p)
        return p

    def _daemon_env(self) -> dict[str, str]:
        env = dict(self.env)
        env["VGPU_CONFIG"] = str(self.work / "no-config.toml")  # built-in defaults + flags
        env.pop("LD_PRELOAD", None)
        return env

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.work / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ---- 1. the GPU -------------------------------------------------------------------------

    def start_gpu(self) -> dict[str, Any]:
        self.state_dir.mkdir(parents=True, mode=0o700)
        if self.real:
            self.env = dict(os.environ)
            import pynvml

            pynvml.nvmlInit()
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(0)
                self.uuid = str(pynvml.nvmlDeviceGetUUID(h))
                self.gpu_memory = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
            finally:
                pynvml.nvmlShutdown()
            self.log(f"[1] real GPU {self.uuid}: {self.gpu_memory / GiB:.1f} GiB")
            return {"uuid": self.uuid, "memory": self.gpu_memory, "simulated": False}
        from sim.fakegpu.harness import FakeGPU

        self.gpu = FakeGPU(self.work / "fakegpu", self.build, gpus=1, memory=10 * GiB, context_overhead=256 * MiB)
        self.stack.callback(self.gpu.close)
        self.env = self.gpu.env
        self.uuid = self.gpu_uuid = self.gpu.uuids[0]
        self.gpu_memory = 10 * GiB
        if self.mig_dynamic:
            from sim.fakegpu.mig import product

            self.gpu.configure([product("h200-141gb", mig_mode=1, context_overhead=256 * MiB)])
            self.uuid = self.gpu_uuid = self.gpu.uuids[0]
            self.gpu_memory = int(product("h200-141gb")["memory"])
            self.log(f"[1] simulated H200 in MIG mode {self.uuid}, no instance yet")
            return {"uuid": self.uuid, "memory": self.gpu_memory, "simulated": True}
        if self.mig_profile:
            from sim.fakegpu.mig import product

            self.gpu.configure([product("h200-141gb", mig_mode=1, context_overhead=256 * MiB)])
            (made,) = self.gpu.mig_create(0, self.mig_profile)
            dev = next(d for d in self.gpu.mig_devices() if d["uuid"] == made["uuid"])
            self.gpu_uuid, self.uuid, self.gpu_memory = self.gpu.uuids[0], made["uuid"], int(dev["memory"])
            self.log(f"[1] simulated H200 in MIG mode, {self.mig_profile} instance {self.uuid}: "
                     f"{self.gpu_memory / GiB:.2f} GiB")  # fmt: skip
            return {"uuid": self.uuid, "memory": self.gpu_memory, "simulated": True}
        self.log(f"[1] simulated GPU {self.uuid}: 10 GiB (sim/fakegpu, state {self.gpu.state_path})")
        return {"uuid": self.uuid, "memory": self.gpu_memory, "simulated": True}

    # ---- 2. device plugin and kubelet -------------------------------------------------------

    def start_plugin(self) -> list[str]:
        from sim.kubelet import FakeKubelet

        kdir = self.work / "kubelet"
        self.kubelet = FakeKubelet(kdir)
        self.kubelet.start()
        self.stack.callback(self.kubelet.stop)
        self.plugin = self._spawn(
            [
                *_command("vgpu-device-plugin", "device_plugin"),
                "--kubelet-dir",
                str(kdir),
                "--state-dir",
                str(self.state_dir),
                "--device-split-count",
                str(SPLIT),
                "--device-list-strategy",
                self.strategy,
                *(["--mig-strategy", "vgpu"] if self.mig_profile else []),
                *(["--mig-strategy", "dynamic"] if self.mig_dynamic else []),
                "--log-level",
                "info",
            ],
            "device-plugin",
        )
        try:
            ep = self.kubelet.wait_endpoint(RESOURCE, timeout=30)
            devices = ep.wait_devices(lambda d: len(d) == SPLIT, timeout=30)
        except TimeoutError:
            raise StepFailed(
                f"the device plugin did not register {SPLIT} vGPUs:\n{self.tail('device-plugin')}"
            ) from None
        ids = sorted(devices)
        self.log(f"[2] vgpu-device-plugin registered {RESOURCE}: {len(ids)} vGPUs of 1 GPU (split count {SPLIT})")
        return ids

    def admit(self) -> list[Pod]:
        from vgpu import schemas
        from vgpu.paths import Paths

        for pod in self.pods:
            alloc = self.kubelet.admit("default", pod.name, "main", count=pod.vgpus)
            pod.alloc = alloc
            pod.token = alloc.envs.get(TOKEN_ENV, "")
            if not pod.token or alloc.annotations.get(TOKEN_ANNOTATION) != pod.token:
                raise StepFailed(f"Allocate for {pod.name} carried no allocation token: {alloc.envs}")
            if (
                self.strategy == "envvar"
                and not self.mig_dynamic  # the MIG device made for it
                and alloc.envs.get("NVIDIA_VISIBLE_DEVICES") != self.uuid
            ):
                raise StepFailed(f"{pod.name}: NVIDIA_VISIBLE_DEVICES={alloc.envs.get('NVIDIA_VISIBLE_DEVICES')!r}")
            rec = schemas.read_record(Paths(str(self.state_dir)).allocation_record(pod.token))
            [g] = rec.gpus
            pod.uuid, pod.memory_limit, pod.core_percent = g.uuid, g.memory_limit, g.core_percent
            self.log(
                f"    kubelet admitted {pod.name} with {pod.vgpus} x {RESOURCE}: slice "
                f"{pod.memory_limit / GiB:.2f} GiB, compute share {pod.core_percent} %"
            )
        return self.pods

    # ---- 3. containers ------------------------------------------------------------------------

    def _hooks(self) -> dict[str, Any]:
        from node_setup.hookspec import hook_entries

        lib = self.build / "libvgpu.so"
        gargs = [
            "--config",
            str(self.work / "no-config.toml"),
            "--state-dir",
            str(self.state_dir),
            "--library-path",
            str(lib),
            "--log-dir",
            str(self.work / "hook-log"),
            "--log-level",
            "info",
        ]
        entries = hook_entries(sys.executable, gargs, 30, str(self.state_dir))
        return {kind: [entry] for kind, entry in entries.items()}

    def _script(self, pod: Pod) -> str:
        slice_ = pod.memory_limit
        over = slice_ + 64 * MiB  # past the slice (the physical GPU still has plenty free)
        fit = int(slice_ * 0.8) // MiB * MiB  # most of the slice (pod-b's is more than pod-a's whole slice)
        hold = int(slice_ * 0.4) // MiB * MiB  # held during the compute phase
        burn = CTR_BURN  # build/fakegpu/fakegpu-burn, driver API only: runs on the real libcuda too
        python = os.path.realpath(sys.executable)
        import pynvml

        pynvml_dir = os.path.dirname(os.path.realpath(pynvml.__file__))
        return f"""# {pod.name}: what the container sees, allocations, then compute (k8s-vgpu demo)
B={burn}
step() {{ name=$1; shift; "$@" > /demo/$name.out 2> /demo/$name.err; echo $? > /demo/$name.rc; }}
step nvml {python} -I -S /demo/nvml_query.py {pynvml_dir}
step info $B --seconds 0
step over $B --alloc {over} --seconds 0
step fit $B --alloc {fit} --seconds 0
echo done > /demo/phase1
while [ ! -e /demo/go ]; do sleep 0.05; done
step burn $B --alloc {hold} --kernel-us {self.kernel_us} --seconds 600
sleep 600
"""

    def _gpu_runtime(self) -> tuple[str, dict[str, str], str]:
        """The runtime binary that brings the GPU (path, its environment, a note for the log):
        the simulated toolkit's nvidia-container-runtime with a toolkit config of the demo's own;
        on a real node the installed nvidia-container-runtime with the node's config; a GPU
        node without the toolkit: plain runc ("" note = the demo injects the driver itself)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKEGPU_", "LD_", "NVIDIA_CTK_"))}
        if self.gpu is not None:
            from sim.fakegpu import toolkit

            flags: dict[str, Any] = {"container_lib_dir": CTR_LIB_DIR}
            if self.strategy == "volume-mounts":  # NVIDIA's "preventing unprivileged access" setup
                flags.update(accept_volume_mounts=True, accept_envvar_unprivileged=False)
            spec_dir = self.work / "cdi"  # the demo's own: never the node's /etc/cdi, /var/run/cdi
            spec_dir.mkdir(parents=True, exist_ok=True)
            flags["spec_dirs"] = [spec_dir]
            if self.strategy.startswith("cdi"):
                toolkit.write_cdi_spec(spec_dir, self.gpu, container_lib_dir=CTR_LIB_DIR)
            cfg = toolkit.write_toolkit_config(self.work / "toolkit" / "config.toml", self.gpu, **flags)
            env["NVIDIA_CTK_CONFIG_FILE_PATH"] = str(cfg)  # as containerd's environment would carry it
            return str(toolkit.RUNTIME), env, f"the simulated toolkit's nvidia-container-runtime ({cfg})"
        # VGPU_DEMO_RUNTIME overrides the lookup (e.g. a .legacy binary, or `runc` to inject by hand).
        real = os.environ.get("VGPU_DEMO_RUNTIME") or shutil.which("nvidia-container-runtime")
        if real and os.path.basename(real) != "runc":
            return real, dict(os.environ), real
        return "runc", dict(os.environ), ""

    def run_containers(self) -> list[Pod]:
        if not ctr.have_runc():
            raise StepFailed("runc and /bin/busybox are needed (apt-get install runc busybox-static)")
        self.runc_root.mkdir(parents=True, exist_ok=True)
        hooks = self._hooks()
        runtime, runtime_env, via = self._gpu_runtime()
        manual = not via  # a GPU node without NVIDIA's runtime: driver libs and nodes by hand
        mounts, links = ctr.host_mounts(_driver_lib_dirs() if manual else [])
        devices = _nvidia_devices() if manual else []
        burn = {
            "destination": CTR_BURN,
            "type": "bind",
            "source": str(self.build / "fakegpu" / "fakegpu-burn"),
            "options": ["bind", "ro"],
        }
        for pod in self.pods:
            cid = f"{pod.name}-{os.getpid()}"  # runc root and state dir are the demo's own
            alloc = pod.alloc
            if alloc is None or alloc.cdi_devices:
                raise StepFailed(
                    f"{pod.name}: the demo takes env, mounts and annotations from Allocate, not CDI devices"
                )
            # What containerd makes of the Allocate response: its env, its mounts, its annotations
            # (container_annotations passes them through), plus the image's own env.
            env = {"LD_LIBRARY_PATH": CTR_LIB_DIR, **alloc.envs}
            alloc_mounts = [
                {
                    "destination": m.container_path,
                    "type": "bind",
                    "source": m.host_path,
                    "options": ["rbind", "ro" if m.read_only else "rw"],
                }
                for m in alloc.mounts
            ]
            c = ctr.Container(
                cid=cid,
                bundle=self.work / "bundles" / pod.name,
                out=self.work / "out" / pod.name,
                namespace="default",
                pod=pod.name,
                name="main",
                env=env,
                mounts=[burn, *alloc_mounts],
            )
            pod.container = c
            c.out.mkdir(parents=True, exist_ok=True)
            (c.out / "nvml_query.py").write_text(NVML_QUERY)
            script = self._script(pod)
            ctr.write_bundle(
                c,
                script,
                hooks=hooks,
                annotations=dict(alloc.annotations),
                mounts=mounts,
                links=links,
                devices=devices,
            )
            self.stack.callback(ctr.stop, self.runc_root, c)
            try:
                ctr.start(self.runc_root, c, runtime, runtime_env)
            except RuntimeError as e:
                raise StepFailed(f"{pod.name}: {e}") from None
            self.log(
                f"[3] runc started {pod.name} (pid {c.pid}); prestart hook set up its vGPU "
                f"({self.state_dir / 'containers' / cid})"
            )
            if via:
                sel = [f"{k}={v}" for k, v in alloc.envs.items() if k != TOKEN_ENV]
                sel += [f"mount {m.container_path}" for m in alloc.mounts]
                sel += [f"{k}={v}" for k, v in alloc.annotations.items() if k != TOKEN_ANNOTATION]
                gpu = ", ".join(sel)
                self.log(f"    its GPU ({gpu}) came through {via}")
            else:
                self.log("    no nvidia-container-runtime on this node: the demo mounted the driver itself")
        return self.pods

    def isolation(self, timeout: float = 60) -> list[Pod]:
        for pod in self.pods:
            c = pod.container
            assert c is not None
            _wait(partial(_phase1_over, self.runc_root, c), timeout, f"{pod.name}'s first phase")
            if not c.file("phase1").exists():
                raise StepFailed(f"{pod.name} exited early: {_read(c.file('info.err'))}")
            pod.seen = {name: _result(c, name) for name in ("nvml", "info", "over", "fit")}
        for pod in self.pods:
            s = pod.seen
            info, over, fit = s["info"]["json"], s["over"]["json"], s["fit"]["json"]
            nvml = s["nvml"]["json"]
            if s["nvml"]["rc"] != 0 or not isinstance(nvml, list):
                raise StepFailed(f"{pod.name}: NVML query failed: {s['nvml']['err']}")
            devs = {d["uuid"]: d for d in nvml}
            if list(devs) != [pod.uuid]:
                raise StepFailed(f"{pod.name}: NVML shows devices {list(devs)}, expected only {pod.uuid}")
            if devs[pod.uuid]["total"] != pod.memory_limit:
                raise StepFailed(f"{pod.name}: NVML total {devs[pod.uuid]['total']} != slice {pod.memory_limit}")
            if s["info"]["rc"] != 0 or info.get("mem_total") != pod.memory_limit:
                raise StepFailed(
                    f"{pod.name}: cuMemGetInfo total {info.get('mem_total')} != slice {pod.memory_limit} "
                    f"({s['info']['err']})"
                )
            if s["over"]["rc"] != 3 or over.get("alloc_result") != CUDA_ERROR_OUT_OF_MEMORY:
                raise StepFailed(f"{pod.name}: allocating past the slice gave rc={s['over']['rc']} {over}")
            if s["fit"]["rc"] != 0 or fit.get("alloc_result") != 0:
                raise StepFailed(f"{pod.name}: allocating 80 % of its slice failed: rc={s['fit']['rc']} {fit}")
            self.log(
                f"    {pod.name} sees {pod.memory_limit / GiB:.2f} GiB (cuMemGetInfo and NVML); "
                f"cuMemAlloc({over['alloc_bytes'] / GiB:.2f} GiB) -> CUDA_ERROR_OUT_OF_MEMORY, "
                f"cuMemAlloc({fit['alloc_bytes'] / GiB:.2f} GiB) -> CUDA_SUCCESS"
            )
        return self.pods

    # ---- 4. compute shares ---------------------------------------------------------------------

    def _exec_ns(self) -> dict[str, int]:
        """Executed kernel time per pod, the simulator's ground truth (by pid namespace)."""
        ns = {}
        for pod in self.pods:
            assert pod.container is not None
            with contextlib.suppress(OSError):
                ns[os.stat(f"/proc/{pod.container.pid}/ns/pid").st_ino] = pod.name
        out = {p.name: 0 for p in self.pods}
        for proc in self.gpu.state().get("processes", []):
            name = ns.get(int(proc.get("pidns", 0)))
            if name:
                out[name] += sum(int(d.get("exec_ns", 0)) for d in proc.get("devices", []))
        return out

    def _measure(self, seconds: float) -> dict[str, float]:
        """SM use per pod over `seconds`: the simulator's executed kernel time, or (real GPU) the
        mean of the monitor's own measurement, scraped once a second; {} when neither exists."""
        if self.gpu is None:
            if not self.metrics_port:
                return {}
            samples: list[dict[str, float]] = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(1.0)
                per_pod = self._scrape_per_pod()
                samples.append({k: v.get("vgpu_container_sm_use_percent", 0.0) for k, v in per_pod.items()})
            return {p.name: sum(s[p.name] for s in samples) / len(samples) for p in self.pods}
        t0, a = time.monotonic(), self._exec_ns()
        time.sleep(seconds)
        t1, b = time.monotonic(), self._exec_ns()
        return {k: 100.0 * (b[k] - a[k]) / ((t1 - t0) * 1e9) for k in a}

    def compute(
        self, before_s: float = 3.0, settle_timeout: float = 30.0, measure_s: float = 5.0, tolerance_pp: float = 8.0
    ) -> list[Pod]:
        for pod in self.pods:
            assert pod.container is not None
            pod.container.file("go").touch()
        for pod in self.pods:
            c = pod.container
            assert c is not None
            _wait(partial(_burn_running, c), 20, f"{pod.name}'s workload")
        time.sleep(1.0)
        before = self._measure(before_s)
        for pod in self.pods:
            pod.share_before = before.get(pod.name, 0.0)
        if before:
            self.log(
                "[4] both containers saturate the GPU; without the monitor: "
                + ", ".join(f"{p.name} {p.share_before:.0f} %" for p in self.pods)
            )
        else:
            self.log("[4] both containers saturate the GPU")
        self.monitor = self._spawn(
            [
                *_command("vgpu-monitor", "monitor"),
                "--state-dir",
                str(self.state_dir),
                "--metrics-address",
                "127.0.0.1",
                "--metrics-port",
                "0",
                "--policy",
                "contended",
                "--log-level",
                "info",
            ],
            "monitor",
        )
        status = self.state_dir / "monitor" / "status.json"

        def ready() -> bool:
            try:
                st = json.loads(status.read_text())
            except (OSError, ValueError):
                return False
            if self.monitor is not None and self.monitor.poll() is not None:
                raise StepFailed(f"vgpu-monitor exited {self.monitor.returncode}:\n{self.tail('monitor')}")
            self.metrics_port = int(st.get("metrics_port") or 0)
            return bool(st.get("guardian_armed") and self.metrics_port and st.get("pid") == self.monitor.pid)  # type: ignore[union-attr]

        _wait(ready, 30, "vgpu-monitor to start")
        self.log(f"    vgpu-monitor started (policy contended, metrics on 127.0.0.1:{self.metrics_port})")
        deadline = time.monotonic() + settle_timeout
        while True:
            shares = self._measure(2.0)
            if all(abs(shares[p.name] - p.core_percent) <= tolerance_pp for p in self.pods):
                break
            if time.monotonic() > deadline:
                raise StepFailed(
                    "shares did not settle: "
                    + ", ".join(f"{p.name} {shares[p.name]:.0f} % (share {p.core_percent} %)" for p in self.pods)
                )
        after = self._measure(measure_s)
        for pod in self.pods:
            pod.share_after = after[pod.name]
        self.log(
            "    with the monitor: "
            + ", ".join(f"{p.name} {p.share_after:.0f} % (share {p.core_percent} %)" for p in self.pods)
        )
        return self.pods

    def _scrape_per_pod(self) -> dict[str, dict[str, float]]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            self.metrics_text = r.read().decode()
        per_pod: dict[str, dict[str, float]] = {p.name: {} for p in self.pods}
        for fam in text_string_to_metric_families(self.metrics_text):
            for s in fam.samples:
                label = s.labels.get("pod", "")
                if label in per_pod and s.name.startswith("vgpu_container_"):
                    per_pod[label][s.name] = s.value
        return per_pod

    def scrape(self) -> dict[str, dict[str, float]]:
        per_pod = self._scrape_per_pod()
        for pod in self.pods:
            pod.metrics = per_pod[pod.name]
            if "vgpu_container_memory_limit_bytes" not in pod.metrics:
                raise StepFailed(f"/metrics has no series for {pod.name}")
        self.log(
            f"[5] scraped http://127.0.0.1:{self.metrics_port}/metrics: "
            f"{sum(len(v) for v in per_pod.values())} series for the two pods"
        )
        return per_pod

    def ctl_status(self) -> str:
        """`vgpuctl status` on this node: the monitor's status file as a table."""
        r = subprocess.run(
            [*_command("vgpuctl", "vgpuctl.cli"), "status", "--state-dir", str(self.state_dir)],
            env=self._daemon_env(),
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        if r.returncode != 0:
            raise StepFailed(f"vgpuctl status exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    # ---- 5. report ------------------------------------------------------------------------------

    def report(self) -> str:
        head = ("container", "slice", "used", "share", "measured use", "monitor's view")
        rows = [head]
        for p in self.pods:
            m = p.metrics
            used = m.get("vgpu_container_memory_used_bytes", 0.0)
            was = f" (was {p.share_before:.0f} %)" if self.gpu is not None else ""
            measured = f"{p.share_after:.0f} %{was}"
            use, duty = m.get("vgpu_container_sm_use_percent", 0.0), m.get("vgpu_container_duty_ratio", 0.0)
            view = f"{use:.0f} %, duty {duty:.2f}"
            rows.append(
                (
                    f"default/{p.name}/main",
                    f"{p.memory_limit / GiB:.2f} GiB",
                    f"{used / GiB:.2f} GiB",
                    f"{p.core_percent} %",
                    measured,
                    view,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


# ---- helpers ---------------------------------------------------------------------------------


def _command(script: str, module: str) -> list[str]:
    """The installed console script next to this interpreter, else `python -m module`."""
    exe = Path(sys.executable).parent / script
    return [str(exe)] if exe.exists() else [sys.executable, "-m", module]


def _terminate(p: subprocess.Popen[bytes]) -> None:
    from sim.procs import terminate

    terminate(p, 15)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _result(c: ctr.Container, name: str) -> dict[str, Any]:
    out = _read(c.file(f"{name}.out"))
    try:
        parsed: Any = json.loads(out.splitlines()[-1]) if out else None
    except ValueError:
        parsed = None
    rc_text = _read(c.file(f"{name}.rc"))
    return {
        "rc": int(rc_text) if rc_text.lstrip("-").isdigit() else -1,
        "json": parsed if parsed is not None else {},
        "err": _read(c.file(f"{name}.err"))[-500:],
    }


def _phase1_over(runc_root: Path, c: ctr.Container) -> bool:
    return c.file("phase1").exists() or ctr.status(runc_root, c) != "running"


def _burn_running(c: ctr.Container) -> bool:
    try:
        kids = Path(f"/proc/{c.pid}/task/{c.pid}/children").read_text().split()
    except OSError:
        return False
    for k in kids:
        with contextlib.suppress(OSError):
            if "fakegpu-burn" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace"):
                return True
    return False


def _driver_lib_dirs() -> list[str]:
    """Directories of the real driver's libcuda.so.1 and libnvidia-ml.so.1 (ldconfig's cache)."""
    r = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30)
    dirs = set()
    for line in r.stdout.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] in ("libcuda.so.1", "libnvidia-ml.so.1") and path:
            dirs.add(os.path.dirname(path.strip()))
    return sorted(dirs)


def _nvidia_devices() -> list[dict[str, Any]]:
    out = []
    for name in sorted(os.listdir("/dev")):
        if name.startswith("nvidia"):
            st = os.stat(f"/dev/{name}")
            if not (st.st_mode & 0o170000) == 0o020000:  # character devices only
                continue
            out.append(
                {
                    "path": f"/dev/{name}",
                    "type": "c",
                    "major": os.major(st.st_rdev),
                    "minor": os.minor(st.st_rdev),
                    "fileMode": 0o666,
                    "uid": 0,
                    "gid": 0,
                }
            )
    return out


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """Clean-up runs to the end even if Ctrl-C is pressed again."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
