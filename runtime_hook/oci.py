"""Parsing of the OCI state (stdin) and bundle config.json, and the hook's first decision.

This module runs on the hot path of EVERY container on the node (the no-token
case), so it imports nothing beyond the interpreter's built-ins: JSON is
decoded with the C scanner of `_json` directly (vgpu.jsonfast: the `json` package
pulls in `re`, ~7 ms); msgspec and the vgpu config are only imported once a container
turns out to carry an allocation token.  Everything here is a pure function
over bytes/dicts so that it can be fuzzed in-process.
"""

from __future__ import annotations

import os

from vgpu import jsonfast
from vgpu.schemas import TOKEN_ANNOTATION, TOKEN_ENV

TYPE_CHECKING = False  # `typing` imports `re`: keep it off the hot path
if TYPE_CHECKING:
    from typing import Any

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_DEVICES_ROOT = "/var/run/nvidia-container-devices"  # NVIDIA's volume-mounts strategy
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"  # the CDI spec's default annotation prefix
PROC_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"

MAX_STATE_BYTES = 1 << 20
MAX_SPEC_BYTES = 32 << 20

# CRI annotations (containerd) naming the pod and container.
ANN_SANDBOX_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
ANN_SANDBOX_NAME = "io.kubernetes.cri.sandbox-name"
ANN_SANDBOX_UID = "io.kubernetes.cri.sandbox-uid"
ANN_CONTAINER_NAME = "io.kubernetes.cri.container-name"


class HookError(Exception):
    """A failure whose message is the one line the runtime shows the user."""


def oneline(text: str, limit: int = 300) -> str:
    """Untrusted text made fit for a one-line message: printable, collapsed, bounded."""
    text = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(text.split())[:limit]


def loads(data: bytes) -> Any:
    """Decode JSON bytes; raises vgpu.jsonfast.Malformed (a ValueError) with a short reason."""
    return jsonfast.loads(data)


class State:
    __slots__ = ("annotations", "bundle", "id", "pid", "status")

    def __init__(self, id: str, pid: int, bundle: str, annotations: dict[str, str], status: str = "") -> None:
        self.id = id
        self.pid = pid
        self.bundle = bundle
        self.annotations = annotations
        self.status = status


def parse_state(data: bytes) -> State:
    """Validate the OCI state JSON given on stdin."""
    if len(data) > MAX_STATE_BYTES:
        raise jsonfast.Malformed("state larger than 1 MiB")
    obj = loads(data)
    if not isinstance(obj, dict):
        raise jsonfast.Malformed("state is not a JSON object")
    cid = obj.get("id")
    if not isinstance(cid, str) or not cid:
        raise jsonfast.Malformed("state has no container id")
    bundle = obj.get("bundle")
    if not isinstance(bundle, str) or not bundle.startswith("/") or "\0" in bundle:
        raise jsonfast.Malformed("state has no absolute bundle path")
    pid = obj.get("pid", 0)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0 or pid > 1 << 22:
        raise jsonfast.Malformed("state pid is not a valid pid")
    ann = obj.get("annotations") or {}
    if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items()):
        raise jsonfast.Malformed("state annotations are not a string map")
    status = obj.get("status", "")
    return State(id=cid, pid=pid, bundle=bundle, annotations=ann, status=status if isinstance(status, str) else "")


def read_spec_bytes(bundle: str) -> bytes:
    """Read <bundle>/config.json (bounded).  Raises OSError or vgpu.jsonfast.Malformed."""
    fd = os.open(os.path.join(bundle, "config.json"), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000:
            raise jsonfast.Malformed("config.json is not a regular file")
        if st.st_size > MAX_SPEC_BYTES:
            raise jsonfast.Malformed("config.json larger than 32 MiB")
        chunks = []
        total = 0
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            total += len(b)
            if total > MAX_SPEC_BYTES:
                raise jsonfast.Malformed("config.json larger than 32 MiB")
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_spec(data: bytes) -> dict[str, Any]:
    obj = loads(data)
    if not isinstance(obj, dict):
        raise jsonfast.Malformed("config.json is not a JSON object")
    return obj


def env_list(spec: dict[str, Any]) -> list[str]:
    proc = spec.get("process")
    if not isinstance(proc, dict):
        return []
    env = proc.get("env")
    if not isinstance(env, list):
        return []
    return [e for e in env if isinstance(e, str)]


def env_values(spec: dict[str, Any], name: str) -> list[str]:
    """Every value given to `name` in process.env (a crafted spec may repeat a name)."""
    prefix = name + "="
    return [e[len(prefix) :] for e in env_list(spec) if e.startswith(prefix)]


def env_last(spec: dict[str, Any], name: str) -> str | None:
    """The value of `name` a reader of the spec acts on: the LAST occurrence (None when unset).

    containerd's CRI writes the image's Env, then the container's, keeping duplicate keys
    (recorded: tests/data/real-traces/containerd-cri/kubelet-pod-cuda-env-image.config.json has
    the image's NVIDIA_VISIBLE_DEVICES=all first and the device plugin's GPU-<uuid> after it).
    NVIDIA's runtime and legacy hook read the env into a map in order (image.WithEnv,
    internal/config/image/builder.go@v1.20.0), so the last one wins; runc sets the process
    environment in order too, so the container sees the same value.
    """
    prefix = name + "="
    for e in reversed(env_list(spec)):
        if e.startswith(prefix):
            return e[len(prefix) :]
    return None


def find_token(annotations: dict[str, str], spec: dict[str, Any] | None) -> str | None:
    """The allocation token: the annotation (preferred) or the env var; None when neither.

    Raises HookError when the sources disagree: a container must not be able to
    pick between two allocations.
    """
    ann = annotations.get(TOKEN_ANNOTATION)
    spec_ann = spec.get("annotations") if spec else None
    if ann is None and isinstance(spec_ann, dict):
        v = spec_ann.get(TOKEN_ANNOTATION)
        ann = v if isinstance(v, str) else (None if v is None else str(v))
    envs = set(env_values(spec, TOKEN_ENV)) if spec else set()
    if len(envs) > 1:
        raise HookError(f"container env sets {TOKEN_ENV} more than once with different values")
    env = next(iter(envs)) if envs else None
    if ann is not None and env is not None and ann != env:
        raise HookError(f"allocation token in annotation {TOKEN_ANNOTATION} and env {TOKEN_ENV} disagree")
    return ann if ann is not None else env


class Proceed:
    __slots__ = ("spec", "state", "token")

    def __init__(self, state: State, spec: dict[str, Any], token: str) -> None:
        self.state = state
        self.spec = spec
        self.token = token


class Skip:
    """Exit 0.  `log` is a line worth logging (malformed input of a non-vGPU container) or None."""

    __slots__ = ("log",)

    def __init__(self, log: str | None = None) -> None:
        self.log = log


class Fail:
    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


_MARKERS = (TOKEN_ANNOTATION.encode(), TOKEN_ENV.encode())


def mentions_token(raw: bytes) -> bool:
    return any(m in raw for m in _MARKERS)


def decide_prestart(stdin: bytes, read_spec: Any = read_spec_bytes) -> Proceed | Skip | Fail:
    """The hook's first decision, from stdin bytes and a reader of config.json.

    Failure policy (docs/developers/hook.md): input we cannot parse fails the container
    only when it shows an allocation token; otherwise the container is left
    alone (exit 0) and the problem is logged.
    """
    try:
        state = parse_state(stdin)
    except jsonfast.Malformed as e:
        msg = f"malformed OCI state on stdin: {e}"
        return Fail(msg) if mentions_token(stdin[:MAX_STATE_BYTES]) else Skip(msg)
    ann_token = state.annotations.get(TOKEN_ANNOTATION)
    try:
        raw = read_spec(state.bundle)
    except (OSError, jsonfast.Malformed) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        msg = f"cannot read {state.bundle}/config.json: {reason}"
        return Fail(msg) if ann_token is not None else Skip(msg)
    try:
        spec = parse_spec(raw)
    except jsonfast.Malformed as e:
        msg = f"malformed {state.bundle}/config.json: {e}"
        return Fail(msg) if ann_token is not None or mentions_token(raw) else Skip(msg)
    try:
        token = find_token(state.annotations, spec)
    except HookError as e:
        return Fail(str(e))
    if token is None:
        return Skip(None)
    return Proceed(state, spec, token)


def parse_poststop_id(stdin: bytes) -> str:
    """The container id from the poststop state (pid and bundle are not needed)."""
    if len(stdin) > MAX_STATE_BYTES:
        raise jsonfast.Malformed("state larger than 1 MiB")
    obj = loads(stdin)
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        raise jsonfast.Malformed("state has no container id")
    return str(obj["id"])


def _cdi_uuid(name: str) -> str | None:
    """The device of a fully qualified CDI name `vendor/class=device`, else None."""
    kind, sep, dev = name.partition("=")
    vendor, slash, cls = kind.partition("/")
    return dev if sep and slash and vendor and cls and dev and "/" not in cls else None


def _outside(item: str, allowed_uuids: set[str]) -> bool:
    """A device request naming anything but a GPU of the allocation (by UUID, bare or as a CDI
    name of any kind): `all`, indexes, other UUIDs, other CDI devices are outside."""
    if item in allowed_uuids:
        return False
    dev = _cdi_uuid(item)
    return dev is None or dev not in allowed_uuids


# The env variables NVIDIA's runtime takes a device list from: NVIDIA_VISIBLE_DEVICES, and the
# toolkit's `swarm-resource` variables, which take precedence when set (visibleEnvVars in
# internal/config/image/cuda_image.go@v1.20.0; unset by default, DOCKER_RESOURCE_GPU is the value
# NVIDIA's config documents).  The hook cannot read the node's toolkit config on a container's
# start, so it checks both; `vgpuctl doctor` FAILs a toolkit whose swarm-resource names others.
DEVICE_LIST_ENVS = (VISIBLE_DEVICES_ENV, "DOCKER_RESOURCE_GPU")


def visible_devices_outside(
    spec: dict[str, Any], allowed_uuids: set[str], name: str = VISIBLE_DEVICES_ENV
) -> list[str]:
    """Items of NVIDIA_VISIBLE_DEVICES (or another of DEVICE_LIST_ENVS) that name GPUs outside the
    allocation, judged as NVIDIA's runtime reads them: the LAST occurrence of the variable only
    (`env_last`: an image's NVIDIA_VISIBLE_DEVICES=all followed by the device plugin's UUID is
    the UUID), split at commas, items trimmed, empty items skipped (devicesFromEnvvars,
    cuda_image.go@v1.20.0).

    `all`, indices, unknown UUIDs and CDI names of other devices are outside; `none`, `void` and
    the volume-mounts marker (`/var/run/nvidia-container-devices`: the devices are then the
    mounts, or - mounts not accepted - a name no GPU has) name no GPU.  Stricter than the
    runtime where it is cheap: `void,all` is void to NVIDIA (requested["void"]) but refused here.
    """
    bad: list[str] = []
    for item in (env_last(spec, name) or "").split(","):
        item = item.strip()
        if item in ("", "none", "void", VOLUME_DEVICES_ROOT):
            continue
        if _outside(item, allowed_uuids):
            bad.append(item[:64])
    return bad


def _volume_device(rest: str) -> str:
    """The device a volume-mounts request names (cdiDeviceMountRequest.qualifiedName,
    cuda_image.go@v1.20.0): `cdi/<vendor>/<class>=<dev>` as is, `cdi/<vendor>/<class>/<dev>` (the
    device may hold more `/`: SplitN(.., 3)) as `<vendor>/<class>=<dev>`; anything else as is."""
    if rest.startswith("cdi/"):
        name = rest[4:]
        if _cdi_uuid(name) is not None:
            return name
        parts = name.split("/", 2)
        return parts[0] + "/" + parts[1] + "=" + parts[2] if len(parts) == 3 else rest
    return rest


def _gpu_minors(proc_gpus: str) -> dict[int, str]:
    """Device minor -> UUID from the NVIDIA driver's /proc files; {} without the driver."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(proc_gpus)
    except OSError:
        return out
    for n in names:
        minor, uuid = -1, ""
        try:
            with open(os.path.join(proc_gpus, n, "information"), encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, _, val = line.partition(":")
                    if key.strip() == "Device Minor":
                        minor = int(val.strip())
                    elif key.strip() == "GPU UUID":
                        uuid = val.strip()
        except (OSError, ValueError):
            continue
        if minor >= 0 and uuid:
            out[minor] = uuid
    return out


def gpu_requests_outside(
    spec: dict[str, Any],
    allowed_uuids: set[str],
    proc_gpus: str = PROC_NVIDIA_GPUS,
    cdi_prefixes: tuple[str, ...] = (CDI_ANNOTATION_PREFIX,),
) -> list[str]:
    """Every way a container can ask NVIDIA's runtime or a CDI-enabled engine for a GPU, checked
    against the allocation: one problem string per finding, [] when all is inside.

    NVIDIA's runtime takes the first non-empty of: CDI annotations (cdi mode only), /dev/null
    mounts under /var/run/nvidia-container-devices (if accept-...-as-volume-mounts), the env
    (privileged, or accept-...-envvar-when-unprivileged) - CUDA.VisibleDevices in
    internal/config/image/cuda_image.go@v1.20.0.  Which of them it reads depends on the node's
    toolkit config and mode, which the hook does not know, so EVERY source is checked:

    - NVIDIA_VISIBLE_DEVICES and DOCKER_RESOURCE_GPU, the last occurrence of each (what the
      runtime reads, `visible_devices_outside`; uuids, CDI names; `all`, indexes, others
      outside) -- never required: NVIDIA's CDI edits append NVIDIA_VISIBLE_DEVICES=void;
    - mounts at /var/run/nvidia-container-devices<dev> (volume-mounts strategy), matched as the
      runtime does (requestsFromMounts: the cleaned destination starts with the root, no `/`
      required after it, the device is the rest with `/` trimmed); a destination with `..` or
      one that normalises elsewhere is refused outright (the runtime matches the cleaned
      string, the kernel resolves it: never let the two disagree);
    - annotations under cdi.k8s.io/ (also `<x>.cdi.k8s.io/`, the toolkit NRI plugin's form) and
      under every other prefix in `cdi_prefixes` (the node's configured one): comma lists of CDI
      names -- a prefix the engine honours but we did not check would be an unlimited GPU;
    - device nodes /dev/nvidia<N> already in linux.devices (CDI edits containerd applied for
      CRI cdi_devices, or a CDI-mode runtime): with the driver's /proc files each minor must be
      an allocated GPU, without them there must not be more nodes than allocated GPUs.
    """
    bad: list[str] = []
    for name in DEVICE_LIST_ENVS:
        env_bad = visible_devices_outside(spec, allowed_uuids, name)
        if env_bad:
            bad.append(f"{name} names GPUs outside the vGPU allocation: {', '.join(sorted(set(env_bad)))}")
    mounts = spec.get("mounts")
    for m in mounts if isinstance(mounts, list) else []:
        dst = m.get("destination") if isinstance(m, dict) else None
        if not isinstance(dst, str) or "nvidia-container-devices" not in dst:
            continue
        norm = os.path.normpath(dst)
        parts = dst.split("/")
        if ".." in parts or (norm != dst.rstrip("/") and norm.startswith(VOLUME_DEVICES_ROOT)):
            bad.append(f"mount destination {oneline(dst, 120)!r} is not a plain device path")
            continue
        if not norm.startswith(VOLUME_DEVICES_ROOT):
            continue
        dev = norm[len(VOLUME_DEVICES_ROOT) :].strip("/")
        if not dev or dev.startswith("imex/"):  # the root itself; IMEX channels are no GPU
            continue
        dev = _volume_device(dev)
        if _outside(dev, allowed_uuids):
            bad.append(f"volume mount {oneline(norm, 120)} names a GPU outside the vGPU allocation")
    anns = spec.get("annotations")
    for key, value in sorted(anns.items()) if isinstance(anns, dict) else []:
        if not isinstance(key, str) or not (
            any(key.startswith(p) for p in cdi_prefixes) or "." + CDI_ANNOTATION_PREFIX in key
        ):
            continue
        names = [v.strip() for v in str(value).split(",") if v.strip()]
        out = sorted({n[:64] for n in names if _outside(n, allowed_uuids)})
        if out:
            bad.append(f"annotation {oneline(key, 80)} names CDI devices outside the vGPU allocation: {', '.join(out)}")
    linux = spec.get("linux")
    devs = linux.get("devices") if isinstance(linux, dict) else None
    minors = set()
    for d in devs if isinstance(devs, list) else []:
        path = d.get("path") if isinstance(d, dict) else None
        if isinstance(path, str) and path.startswith("/dev/nvidia") and path[11:].isdigit():
            minors.add(int(path[11:]))
    if minors:
        known = _gpu_minors(proc_gpus)
        if known:
            out = sorted(f"/dev/nvidia{m}" for m in minors if known.get(m) not in allowed_uuids)
            if out:
                bad.append(f"device nodes of GPUs outside the vGPU allocation: {', '.join(out)}")
        elif len(minors) > len(allowed_uuids):
            bad.append(f"{len(minors)} GPU device nodes for {len(allowed_uuids)} allocated GPUs")
    return bad


def rootfs_path(spec: dict[str, Any], bundle: str) -> str:
    root = spec.get("root")
    path = root.get("path") if isinstance(root, dict) else None
    if not isinstance(path, str) or not path or "\0" in path:
        raise HookError("config.json has no root.path")
    return os.path.normpath(path if path.startswith("/") else os.path.join(bundle, path))


def rootfs_readonly(spec: dict[str, Any]) -> bool:
    root = spec.get("root")
    return bool(isinstance(root, dict) and root.get("readonly") is True)


def pod_info(annotations: dict[str, str]) -> dict[str, str]:
    return {
        "pod_namespace": annotations.get(ANN_SANDBOX_NAMESPACE, "")[:253],
        "pod_name": annotations.get(ANN_SANDBOX_NAME, "")[:253],
        "pod_uid": annotations.get(ANN_SANDBOX_UID, "")[:64],
        "container_name": annotations.get(ANN_CONTAINER_NAME, "")[:253],
    }


def cgroup_path(spec: dict[str, Any]) -> str:
    linux = spec.get("linux")
    p = linux.get("cgroupsPath") if isinstance(linux, dict) else None
    return p[:4096] if isinstance(p, str) else ""
