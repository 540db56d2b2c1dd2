"""vgpu-hook: the OCI prestart/poststop hook (standard library only; entry: runtime_hook.main)."""
