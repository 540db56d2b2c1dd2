"""Parsing of the OCI state (stdin) and bundle config.json, and the hook's first decision.

This module runs on the hot path of EVERY container on the node (the no-token
case), so it imports nothing beyond the interpreter's built-ins: JSON is
decoded with the C scanner of `_json` directly (the `json` package pulls in
`re`, ~7 ms); msgspec and the vgpu config are only imported once a container
turns out to carry an allocation token.  Everything here is a pure function
over bytes/dicts so that it can be fuzzed in-process.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # `typing` imports `re`: keep it off the hot path
if TYPE_CHECKING:
    from typing import Any

# Mirrors of vgpu.schemas.TOKEN_ENV / TOKEN_ANNOTATION (importing vgpu.schemas
# would import msgspec on the hot path).  tests/hook/test_oci.py checks they agree.
TOKEN_ENV = "VGPU_ALLOCATION_TOKEN"
TOKEN_ANNOTATION = "vgpu.k8s.io/allocation-token"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"

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


class _Malformed(ValueError):
    pass


def _const(name: str) -> Any:
    raise _Malformed(f"non-standard JSON constant {name}")


def _make_loads() -> Any:
    try:
        import _json  # the C accelerator; no `re`, no json package

        class _Ctx:
            strict = True
            object_hook = None
            object_pairs_hook = None
            parse_float = float
            parse_int = int
            parse_constant = staticmethod(_const)
            memo: dict[str, str] = {}

        scan = _json.make_scanner(_Ctx())  # type: ignore[arg-type]
    except Exception:  # pragma: no cover - interpreters without _json
        import json

        return json.loads

    ws = " \t\n\r"

    def loads(text: str) -> Any:
        n = len(text)
        i = 0
        while i < n and text[i] in ws:
            i += 1
        try:
            obj, end = scan(text, i)
        except RecursionError:
            raise
        except Exception:
            # Error path only: the C scanner reports errors through json.decoder's
            # JSONDecodeError and raises SystemError when that module is not
            # loaded yet.  Let the json package produce the real message.
            import json

            json.loads(text)
            raise _Malformed(f"no JSON value at offset {i}") from None
        while end < n and text[end] in ws:
            end += 1
        if end != n:
            raise _Malformed(f"extra data at offset {end}")
        return obj

    return loads


_loads = _make_loads()


def loads(data: bytes) -> Any:
    """Decode JSON bytes; raises _Malformed (a ValueError) with a short reason."""
    try:
        return _loads(data.decode("utf-8"))
    except _Malformed:
        raise
    except RecursionError:
        raise _Malformed("JSON nested too deeply") from None
    except (ValueError, TypeError) as e:  # UnicodeDecodeError, JSONDecodeError
        raise _Malformed(str(e).split("\n", 1)[0][:120]) from None


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
        raise _Malformed("state larger than 1 MiB")
    obj = loads(data)
    if not isinstance(obj, dict):
        raise _Malformed("state is not a JSON object")
    cid = obj.get("id")
    if not isinstance(cid, str) or not cid:
        raise _Malformed("state has no container id")
    bundle = obj.get("bundle")
    if not isinstance(bundle, str) or not bundle.startswith("/") or "\0" in bundle:
        raise _Malformed("state has no absolute bundle path")
    pid = obj.get("pid", 0)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0 or pid > 1 << 22:
        raise _Malformed("state pid is not a valid pid")
    ann = obj.get("annotations") or {}
    if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items()):
        raise _Malformed("state annotations are not a string map")
    status = obj.get("status", "")
    return State(id=cid, pid=pid, bundle=bundle, annotations=ann, status=status if isinstance(status, str) else "")


def read_spec_bytes(bundle: str) -> bytes:
    """Read <bundle>/config.json (bounded).  Raises OSError or _Malformed."""
    fd = os.open(os.path.join(bundle, "config.json"), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000:
            raise _Malformed("config.json is not a regular file")
        if st.st_size > MAX_SPEC_BYTES:
            raise _Malformed("config.json larger than 32 MiB")
        chunks = []
        total = 0
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            total += len(b)
            if total > MAX_SPEC_BYTES:
                raise _Malformed("config.json larger than 32 MiB")
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_spec(data: bytes) -> dict[str, Any]:
    obj = loads(data)
    if not isinstance(obj, dict):
        raise _Malformed("config.json is not a JSON object")
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

    Failure policy (docs/hook.md): input we cannot parse fails the container
    only when it shows an allocation token; otherwise the container is left
    alone (exit 0) and the problem is logged.
    """
    try:
        state = parse_state(stdin)
    except _Malformed as e:
        msg = f"malformed OCI state on stdin: {e}"
        return Fail(msg) if mentions_token(stdin[:MAX_STATE_BYTES]) else Skip(msg)
    ann_token = state.annotations.get(TOKEN_ANNOTATION)
    try:
        raw = read_spec(state.bundle)
    except (OSError, _Malformed) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        msg = f"cannot read {state.bundle}/config.json: {reason}"
        return Fail(msg) if ann_token is not None else Skip(msg)
    try:
        spec = parse_spec(raw)
    except _Malformed as e:
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
        raise _Malformed("state larger than 1 MiB")
    obj = loads(stdin)
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        raise _Malformed("state has no container id")
    return str(obj["id"])


def visible_devices_outside(spec: dict[str, Any], allowed_uuids: set[str]) -> list[str]:
    """Entries of NVIDIA_VISIBLE_DEVICES that name GPUs outside the allocation.

    `all`, indices and unknown UUIDs are outside; `none`, `void` and empty
    name no GPU.  Every occurrence of the variable counts.
    """
    bad: list[str] = []
    for value in env_values(spec, VISIBLE_DEVICES_ENV):
        v = value.strip()
        if v in ("", "none", "void"):
            continue
        for item in v.split(","):
            item = item.strip()
            if item not in allowed_uuids:
                bad.append(item[:64])
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
