"""vgpu-monitor: compute-share enforcer, memory backstop, metrics."""
