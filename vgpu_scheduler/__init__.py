"""vgpu-scheduler: places memory- and compute-sized vGPU requests across the cluster.

A kube-scheduler extender (filter/prioritize/bind) and a mutating admission webhook. Filter and
score are pure functions over a snapshot (`snapshot`, `fit`); API I/O stays at the edges
(`kube`, `state`, `extender`, `webhook`, `leader`). docs/developers/scheduler.md describes it.
"""
