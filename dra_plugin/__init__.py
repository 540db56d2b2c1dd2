"""vgpu-dra-plugin: the kubelet DRA front end of the node agent (docs/dra.md)."""
