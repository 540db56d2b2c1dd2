"""The scheduler's configuration (flags of `vgpu-scheduler`; one msgspec schema)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from vgpu.scheduling import DEFAULT_STALE_AFTER_S, RESOURCE_GPU

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
Policy = Annotated[str, msgspec.Meta(pattern="^(binpack|spread)$")]
Serve = Annotated[str, msgspec.Meta(pattern="^(all|extender|webhook)$")]


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    def __post_init__(self) -> None:
        if self.follow_lease and self.leader_elect:
            raise ValueError("follow_lease and leader_elect exclude each other (one gate for the verbs)")
        if self.follow_lease and not self.handover_s > self.retry_period_s:
            # The previous replica learns of a released Lease within one poll: the next one
            # must wait longer than that before relisting (follow.py, docs/developers/scheduler.md).
            raise ValueError("follow_lease needs handover_s > retry_period_s")

    scheduler_name: str = "vgpu-scheduler"  # the kube-scheduler profile the webhook sends vGPU pods to
    # The webhook replaces an empty or "default-scheduler" schedulerName; any other name is the
    # user's choice and is left alone (HAMi #1162).
    overwrite_default_scheduler: bool = True
    node_policy: Policy = "binpack"
    gpu_policy: Policy = "spread"
    # Defaults for a container that gives only nvidia.com/gpu: 0 / -1 mean "the GPU's 1/K slice"
    # (memory_schedulable / split_count, cores / split_count), so existing pods keep their meaning.
    default_gpumem_mib: Annotated[int, msgspec.Meta(ge=0)] = 0
    default_gpucores: Annotated[int, msgspec.Meta(ge=-1, le=100)] = -1
    # The webhook adds nvidia.com/gpu: this many when only gpumem/gpumem-percentage/gpucores is given.
    default_gpu_count: Annotated[int, msgspec.Meta(ge=1)] = 1
    # The webhook refuses a pod whose size no GPU or node of the cluster has today (more MiB or
    # compute per GPU than any GPU offers, more GPUs than any node). Off (the default): the pod is
    # admitted and stays Pending with the extender's reason, so that an autoscaler
    # (cluster-autoscaler, Karpenter: they add nodes for Pending pods only) can bring a node
    # that holds it; the preempt verb keeps it from evicting anyone (docs/developers/scheduler.md, "Webhook").
    refuse_oversized: bool = False
    resource_name: str = RESOURCE_GPU
    stale_after_s: PositiveFloat = DEFAULT_STALE_AFTER_S
    node_label_selector: str = ""  # only these Nodes are considered (label selector syntax)
    conflict_retries: Annotated[int, msgspec.Meta(ge=0)] = 5  # API 409s retried per bind
    # A filter's choice is held in memory until kube-scheduler's bind writes it; without a bind
    # it stops counting after this long (a later bind re-checks it against the usage of then).
    reservation_ttl_s: PositiveFloat = 30.0
    api_timeout_s: PositiveFloat = 10.0
    # A filter whose ExtenderArgs carry full Nodes (nodeCacheCapable: false) decides on the Node
    # objects given; with simulate_full_nodes it writes nothing (cluster-autoscaler's simulations).
    simulate_full_nodes: bool = False
    # What this process serves: "all" (extender verbs + webhook), "extender" (/filter,
    # /prioritize, /bind) or "webhook" (/webhook only: no pod state, no lease; it keeps only the
    # Node view that admission sizes are checked against). /healthz and /readyz always.
    serve: Serve = "all"
    # Follow mode (what the chart uses): serve filter/bind iff kube-scheduler's own Lease
    # ("namespace/name", the KubeSchedulerConfiguration's leaderElection.resourceNamespace and
    # resourceName) is held by the kube-scheduler of this pod and not expired (follow.py).
    follow_lease: Annotated[str, msgspec.Meta(pattern="^$|^[a-z0-9.-]+/[a-z0-9.-]+$")] = ""
    follow_hostname: str = ""  # the holder's hostname to match; default: this host's (the pod's) name
    # Stop serving this long before the followed Lease expires, and wait this long after becoming
    # the serving one before relisting: in-flight writes of the previous one land first.
    handover_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    # Own-lease mode (an extender without a co-located kube-scheduler): coordination.k8s.io/v1 Lease.
    leader_elect: bool = False
    lease_namespace: str = "kube-system"
    lease_name: str = "vgpu-scheduler"
    lease_duration_s: PositiveFloat = 15.0
    renew_deadline_s: PositiveFloat = 10.0
    retry_period_s: PositiveFloat = 2.0
    identity: str = ""  # default: host name + pid
