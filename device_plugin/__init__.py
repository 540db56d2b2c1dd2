"""vgpu-device-plugin: kubelet device plugin that splits GPUs into vGPUs."""
