"""How an Allocate response names the GPUs: NVIDIA's `--device-list-strategy` (a list).

The strategies and what each puts in the ContainerAllocateResponse are NVIDIA's device plugin's
(`internal/plugin/server.go@v0.20.0`, reference gpu-injection.md §3):

- `envvar` (default): envs NVIDIA_VISIBLE_DEVICES=<uuid>,...
- `volume-mounts`: envs NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices and, per GPU, a
  read-only mount of /dev/null at /var/run/nvidia-container-devices/<uuid>
- `cdi-annotations`: annotations <prefix>vgpu-device-plugin_<id> = "<kind>=<uuid>,..."
- `cdi-cri`: cdi_devices [{name: "<kind>=<uuid>"}, ...] (kubelet >= 1.29, containerd >= 1.7.2)

`volume-mounts` replaces the envvar value when both are listed, as NVIDIA's does.  With only CDI
strategies NVIDIA's plugin sets no NVIDIA_VISIBLE_DEVICES (`getAllocateResponse`); we set it to
`void`.  Why: an nvidia/cuda image carries `ENV NVIDIA_VISIBLE_DEVICES=all`, containerd appends the
response's env after the image's and NVIDIA's runtime takes the last one.  Without our `void` a
runtime in legacy or jit-cdi mode (or `auto` with that `all` among its requests, which then
resolves to jit-cdi) would inject every GPU of the node next to the CDI devices, and the hook
would have to refuse the container.  `void` means "no GPU from the env" to the runtime and the
legacy hook (reference gpu-injection.md §2); the GPUs come from the CDI names alone.  Our allocation token (env and
annotation) is added by the caller in every strategy: the annotation is how the hook finds the
record, the env its fallback.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Literal

import msgspec

from device_plugin.api import deviceplugin_pb2 as pb

Name = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]
NAMES: tuple[str, ...] = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_ROOT = "/var/run/nvidia-container-devices"
PLUGIN_NAME = "vgpu-device-plugin"  # the <plugin> part of cdi.k8s.io/<plugin>_<id>


class Strategy(msgspec.Struct, frozen=True, kw_only=True):
    names: tuple[str, ...] = ("envvar",)
    cdi_kind: str = "nvidia.com/gpu"
    annotation_prefix: str = "cdi.k8s.io/"


def parse_list(text: str) -> list[str]:
    """`--device-list-strategy envvar,cdi-cri` -> ["envvar", "cdi-cri"] (validated by the config)."""
    return [p.strip() for p in text.split(",") if p.strip()]


def fill(resp: pb.ContainerAllocateResponse, uuids: Sequence[str], strategy: Strategy) -> None:
    """Adds the GPU selection of `uuids` to `resp` in every listed form."""
    names = set(strategy.names)
    if "envvar" in names:
        resp.envs[VISIBLE_DEVICES_ENV] = ",".join(uuids)
    if "volume-mounts" in names:
        resp.envs[VISIBLE_DEVICES_ENV] = VOLUME_ROOT
        for u in uuids:
            resp.mounts.add(container_path=f"{VOLUME_ROOT}/{u}", host_path="/dev/null", read_only=True)
    if not names & {"envvar", "volume-mounts"}:
        resp.envs[VISIBLE_DEVICES_ENV] = "void"  # the image's `all` must not add GPUs (see above)
    qualified = [f"{strategy.cdi_kind}={u}" for u in uuids]
    if "cdi-annotations" in names:
        # cdiapi.UpdateAnnotations: key <prefix><plugin>_<device id>, name part <= 63 characters.
        key = f"{strategy.annotation_prefix}{PLUGIN_NAME}_{secrets.token_hex(8)}"
        resp.annotations[key] = ",".join(qualified)
    if "cdi-cri" in names:
        for q in qualified:
            resp.cdi_devices.add(name=q)
