"""Generated kubelet API modules (device plugin v1beta1, PodResources v1).

Regenerate with `make proto` (device_plugin/api/gen.sh); the .proto files are
the project's own, with the public API's package names and field numbers.
"""
