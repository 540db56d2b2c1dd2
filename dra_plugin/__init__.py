"""vgpu-dra-plugin: the kubelet DRA front end of the node agent (docs/developers/dra-plugin.md)."""
