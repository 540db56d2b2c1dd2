"""vgpu-node-setup: puts k8s-vgpu's host parts on a node from the container image.

Run as a privileged init container with the host's root mounted (default /host), or by hand.
It copies libvgpu.so and the OCI hook (standard-library Python only, run by the host's own
python3) under a prefix (default /usr/local/vgpu), then wires containerd through
`vgpu-hook containerd install --root <host root>`.  `uninstall` undoes all of it.
`install --library-only` (DRA nodes, docs/developers/dra-plugin.md) puts only the library there: the DRA plugin's
CDI specs mount it into the containers, so no hook, no containerd handler and no host python3.
"""
