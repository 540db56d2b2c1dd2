"""Node detection: how this node's containerd and NVIDIA toolkit put a GPU into a container.

`detect.detect()` returns one `NodeFacts` struct (msgspec): the effective containerd config,
every `nvidia*` runtime handler with its `BinaryName`, the toolkit config that runtime
reads, CDI state and specs, and the node type:

- `N1-legacy`   host toolkit, `nvidia` handler, legacy mode (toolkit <= 1.17 `auto`, or `legacy`)
- `N1-jit-cdi`  host toolkit >= 1.18 in `auto`/`jit-cdi` mode (builds CDI edits in memory)
- `N1-cdi`      host toolkit in `cdi` mode (`nvidia-ctk config` with mode = "cdi"; usually
                `nvidia-ctk runtime configure --cdi.enabled` and `nvidia-ctk cdi generate`)
- `N2`          the GPU Operator's toolkit (wrappers under /usr/local/nvidia/toolkit) in `auto` mode
- `N3`          the GPU Operator's toolkit in `cdi` mode (its installer also sets
                `nvidia-container-runtime-hook.skip-mode-detection = true`)
- `none`        no NVIDIA runtime handler

Installer side only (`vgpu-hook containerd ...`, `vgpuctl doctor`): msgspec and tomllib are
fine here; the per-container hook path (runtime_hook) never imports this package.

Every file is read under `root.Root` (`--root DIR`, the host's `/` mounted into an installer
container): paths named *in* configs are host paths and are resolved inside DIR, symlinks
included (an absolute link target is the host's, so it is re-rooted, never followed into
the installer's own filesystem).

One module per job: `root` (the host tree under --root), `tomlmerge` (containerd's config files
and merge rules), `dump` (the containerd binary: version, `config dump`), `toolkit` (the NVIDIA
runtime's config), `cdi` (CDI specs), `classify` (handlers and the node type, from what was read),
`facts` (the structs), `detect` (reads the node, builds the facts), `report` (human lines, JSON).
"""
