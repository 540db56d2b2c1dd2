"""Mutating admission webhook (admission.k8s.io/v1 AdmissionReview) for pods asking for vGPUs.

On CREATE of a pod with a vGPU resource in any container:
- adds `nvidia.com/gpu: <default_gpu_count>` to a container that gives only gpumem,
  gpumem-percentage or gpucores (memory and cores left absent stay absent: the scheduler applies
  their defaults per GPU at filter time, so "1/K of the GPU" follows the GPU chosen);
- sets `spec.schedulerName` to ours when it is empty or "default-scheduler" (with
  overwrite_default_scheduler); any other name is the user's choice and is kept;
- rejects, with the reason, invalid quantities or annotations (policies, type/UUID lists,
  numa-bind); with `refuse_oversized` also sizes no GPU of the cluster has today (more GPUs than
  any node offers, more MiB than any GPU has). By default such pods are admitted: they stay
  Pending with the extender's reason, where an autoscaler can see them. While no node offers
  GPUs at all, sizes are not judged (the pod stays Pending with the filter's reasons instead of
  being refused during a device plugin restart).
The response is a JSONPatch; applying it and reviewing again allows with no patch.

The answer is what kube-apiserver's VerifyAdmissionResponse (k8s.io/apiserver/pkg/admission/
plugin/webhook/request/admissionreview.go) accepts from a mutating webhook: apiVersion
admission.k8s.io/v1 and kind AdmissionReview, response.uid equal to request.uid, and patch and
patchType together or neither. A pod made from generateName arrives with neither request.name nor
metadata.name (tests/data/real-traces/webhook/d-job-created-pod-generateName.json).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from typing import Any

from vgpu import scheduling as sc
from vgpu_scheduler import requests
from vgpu_scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MiB = 1 << 20
Limits = Callable[[], tuple[int, int, int]]
API_VERSION = "admission.k8s.io/v1"


def _esc(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def mutate(pod: Obj, cfg: SchedulerConfig, limits: Limits) -> list[Obj]:
    """The JSONPatch for this pod; RequestError (the reason) when it must be rejected."""
    if not requests.wants_vgpu(pod, cfg.resource_name):
        return []
    ops: list[Obj] = []
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            if not requests.asks_vgpu(c, cfg.resource_name):
                continue
            res = c.get("resources") or {}
            lim, req = res.get("limits") or {}, res.get("requests") or {}
            if cfg.resource_name in lim or cfg.resource_name in req:
                continue
            value = str(cfg.default_gpu_count)
            if "resources" not in c:
                ops.append(
                    {"op": "add", "path": f"/spec/{key}/{i}/resources", "value": {"limits": {cfg.resource_name: value}}}
                )
            elif "limits" not in res:
                ops.append(
                    {"op": "add", "path": f"/spec/{key}/{i}/resources/limits", "value": {cfg.resource_name: value}}
                )
            else:
                ops.append(
                    {"op": "add", "path": f"/spec/{key}/{i}/resources/limits/{_esc(cfg.resource_name)}", "value": value}
                )
    # Validate what the pod will be (the patch applied).
    after = json.loads(json.dumps(pod))
    for op in ops:
        parts = op["path"].split("/")[2:]
        cur = after["spec"]
        for p in parts[:-1]:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p.replace("~1", "/").replace("~0", "~")]
        cur[parts[-1].replace("~1", "/").replace("~0", "~")] = op["value"]
    reqs = requests.container_requests(after, cfg.resource_name)
    requests.pod_options((pod.get("metadata") or {}).get("annotations"), cfg.node_policy, cfg.gpu_policy)
    most_gpus, most_mem, most_cores = (0, 0, 0) if not cfg.refuse_oversized else limits()
    if most_gpus > 0:
        for r in reqs:
            if r.count > most_gpus:
                raise requests.RequestError(
                    f"container {r.name}: {r.count} GPUs asked; no node offers more than {most_gpus}"
                )
            if r.mem_mib is not None and r.mem_mib * MiB > most_mem:
                raise requests.RequestError(
                    f"container {r.name}: {r.mem_mib} MiB per GPU asked; no GPU has more than {most_mem // MiB} MiB"
                )
            if r.cores is not None and r.cores > most_cores:
                raise requests.RequestError(
                    f"container {r.name}: {r.cores} percent compute asked; no GPU offers more than {most_cores} percent"
                )
    name = spec.get("schedulerName") or ""
    ours = not name or name == cfg.scheduler_name or (name == "default-scheduler" and cfg.overwrite_default_scheduler)
    if ours:
        # Node-level totals kube-scheduler counts, so a pod blocked by GPU memory or compute
        # reaches preemption (docs/developers/scheduler.md, "Preemption"); on the pod as the ops so far leave it.
        want = {r.name: sc.node_level_requests(r.count, r.mem_mib, r.cores) for r in reqs}
        ops += sc.node_level_patch(after.get("spec") or {}, want)
    if not name or (name == "default-scheduler" and cfg.overwrite_default_scheduler):
        ops.append(
            {
                "op": "replace" if "schedulerName" in spec else "add",
                "path": "/spec/schedulerName",
                "value": cfg.scheduler_name,
            }
        )
    return ops


def check_request(body: Any) -> None:
    """ValueError unless `body` is an AdmissionReview v1 request that can be answered (has a uid)."""
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    if body.get("apiVersion") != API_VERSION or body.get("kind") != "AdmissionReview":
        raise ValueError(
            f"expected apiVersion {API_VERSION} kind AdmissionReview, got {body.get('apiVersion')!r} "
            f"{body.get('kind')!r} (admissionReviewVersions must be [v1])"
        )
    req = body.get("request")
    if not isinstance(req, dict) or not isinstance(req.get("uid"), str) or not req["uid"]:
        raise ValueError("request.uid is missing")


def review(body: Obj, cfg: SchedulerConfig, limits: Limits) -> Obj:
    """The AdmissionReview v1 answer to an AdmissionReview v1 request (check_request passed)."""
    req = body["request"]
    resp: Obj = {"uid": req["uid"], "allowed": True}
    out = {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": resp}
    kind = (req.get("kind") or {}).get("kind")
    if kind != "Pod" or req.get("operation") not in ("CREATE", None):
        return out
    pod = req.get("object") or {}
    try:
        ops = mutate(pod, cfg, limits)
    except requests.RequestError as e:
        meta = pod.get("metadata") or {}
        who = meta.get("name") or meta.get("generateName") or "pod"
        log.info("webhook: rejected %s/%s: %s", req.get("namespace"), who, e)
        resp["allowed"] = False
        resp["status"] = {"code": 400, "reason": "BadRequest", "message": f"vgpu-scheduler: {e}"}
        return out
    if ops:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return out
