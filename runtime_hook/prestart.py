"""`vgpu-hook prestart` for a container that carries an allocation token.

Steps (docs/developers/hook.md): validate the container id and the record, check the
container's GPU requests against it (NVIDIA_VISIBLE_DEVICES, volume mounts, CDI
annotations, injected device nodes: oci.gpu_requests_outside), create the per-container state directory
(limits, region, metadata; ld.so.preload is written by the mount helper once
it has read the image's own list), then bind-mount everything into the
container's mount namespace.  Any failure removes the state directory and
raises HookError with the line the runtime shows the user.
"""

from __future__ import annotations

import os
import stat
import time

from runtime_hook import hooklog, mounts, oci
from runtime_hook.oci import HookError
from vgpu import limits as vlimits
from vgpu import paths as vpaths
from vgpu import schemas, statedir
from vgpu.log import kv


def load_record(p: vpaths.Paths, token: str) -> schemas.AllocationRecord:
    if not vpaths.valid_token(token):
        raise HookError(f"invalid vGPU allocation token {token[:40]!r} (expected 32 lowercase hex digits)")
    path = p.allocation_record(token)
    try:
        rec = schemas.read_record(path)
    except FileNotFoundError:
        raise HookError(f"unknown vGPU allocation token {token} (no record {path})") from None
    except OSError as e:
        raise HookError(f"cannot read vGPU allocation record {path}: {e.strerror}") from None
    except schemas.SchemaError as e:
        raise HookError(f"malformed vGPU allocation record {path}: {oci.oneline(str(e))}") from None
    if rec.token != token:
        raise HookError(f"vGPU allocation record {path} belongs to another token")
    if not rec.gpus:
        raise HookError(f"vGPU allocation record {path} lists no GPU")
    try:
        vlimits.from_record(rec)  # an oversubscribed record must say how much may be on the GPU
    except vlimits.LimitsError as e:
        raise HookError(f"vGPU allocation record {path}: {oci.oneline(str(e))}") from None
    return rec


def check_visible_devices(
    spec: dict[str, object], rec: schemas.AllocationRecord, cdi_prefixes: tuple[str, ...] = (oci.CDI_ANNOTATION_PREFIX,)
) -> None:
    """Refuse a container that asks for a GPU outside its record, in any of the forms NVIDIA's
    runtime or a CDI engine honours (env, volume mounts, CDI annotations, device nodes already
    injected): the limits are per GPU of the record, another GPU would be unlimited."""
    bad = oci.gpu_requests_outside(spec, {g.uuid for g in rec.gpus}, cdi_prefixes=cdi_prefixes)  # type: ignore[arg-type]
    if bad:
        raise HookError("; ".join(bad))


def proc_start_time(pid: int) -> int:
    """Start time (clock ticks since boot) of `pid`, 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def make_state_dir(p: vpaths.Paths, cid: str, rec: schemas.AllocationRecord, metadata: bytes) -> str:
    """Create <state>/containers/<id>/ with limits, region and metadata.json."""
    cdir = p.container_dir(cid)
    statedir.make(cdir)
    statedir.populate(cdir, vlimits.from_record(rec), vpaths.METADATA_FILE, metadata)
    return cdir


def run(
    decision: oci.Proceed,
    state_dir: str,
    library_path: str,
    cdi_prefixes: tuple[str, ...] = (oci.CDI_ANNOTATION_PREFIX,),
) -> None:
    """Set up the vGPU container or raise HookError.  `cdi_prefixes`: every CDI annotation
    prefix the node's engine may honour (the default and the device plugin's configured one)."""
    state, spec, token = decision.state, decision.spec, decision.token
    p = vpaths.Paths(state_dir)
    if not vpaths.valid_container_id(state.id):
        raise HookError(f"invalid container id {state.id[:40]!r}")
    if state.pid <= 0:
        raise HookError("OCI state has no container pid")
    rec = load_record(p, token)
    check_visible_devices(spec, rec, cdi_prefixes)
    root = oci.rootfs_path(spec, state.bundle)
    try:
        lst = os.stat(library_path)
    except OSError as e:
        raise HookError(f"vGPU library {library_path}: {e.strerror}") from None
    if not stat.S_ISREG(lst.st_mode):
        raise HookError(f"vGPU library {library_path} is not a regular file")
    pod = oci.pod_info(state.annotations)
    meta = schemas.ContainerMetadata(
        container_id=state.id,
        init_pid=state.pid,
        init_start_time=proc_start_time(state.pid),
        created=time.time(),
        token=token,
        pod_namespace=pod["pod_namespace"],
        pod_name=pod["pod_name"],
        container_name=pod["container_name"],
        pod_uid=pod["pod_uid"],
        cgroup_path=oci.cgroup_path(spec),
        gpus=rec.gpus,
    ).encode()
    if not os.path.isdir(f"/proc/{state.pid}"):
        raise HookError(f"container init (pid {state.pid}) is gone")
    try:
        cdir = make_state_dir(p, state.id, rec, meta)
    except (OSError, ValueError) as e:
        _cleanup(p, state.id)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise HookError(f"cannot create vGPU state for container {state.id}: {reason}") from None
    binds = [
        mounts.BindSpec(library_path, vpaths.CONTAINER_LIBRARY, readonly=True),
        mounts.BindSpec(os.path.join(cdir, vpaths.LIMITS_FILE), vpaths.CONTAINER_LIMITS, readonly=True),
        mounts.BindSpec(os.path.join(cdir, vpaths.REGION_FILE), vpaths.CONTAINER_REGION, readonly=False),
        mounts.BindSpec(os.path.join(cdir, vpaths.PRELOAD_FILE), vpaths.CONTAINER_PRELOAD, readonly=True),
    ]
    try:
        mounts.mount_into_container(
            state.pid,
            root,
            binds,
            preload_out=os.path.join(cdir, vpaths.PRELOAD_FILE),
            preload_target=vpaths.CONTAINER_PRELOAD,
            library=vpaths.CONTAINER_LIBRARY,
        )
    except mounts.MountError as e:
        _cleanup(p, state.id)
        raise HookError(f"cannot set up vGPU isolation in container {state.id}: {e}") from None
    except OSError as e:
        _cleanup(p, state.id)
        raise HookError(f"cannot set up vGPU isolation in container {state.id}: {e.strerror or e}") from None
    hooklog.log.info(
        kv(
            "vgpu container prepared",
            id=state.id,
            pid=state.pid,
            token=token,
            gpus=",".join(g.uuid for g in rec.gpus),
            pod=f"{pod['pod_namespace']}/{pod['pod_name']}",
        )
    )


def _cleanup(p: vpaths.Paths, cid: str) -> None:
    try:
        statedir.remove(p.container_dir(cid))
    except OSError as e:
        hooklog.log.warning(kv("cannot remove state dir", id=cid, error=e.strerror))
