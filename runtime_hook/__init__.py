"""vgpu-hook: OCI prestart/poststop hook and containerd configuration."""
