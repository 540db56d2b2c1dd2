"""`vgpu-hook containerd install | uninstall | print | detect`: wire the hook into containerd.

The hook travels in a base runtime spec (containerd's default spec plus our
prestart and poststop hooks, each with an explicit `env` and `timeout`: a hook
without `env` may inherit the image's environment, CVE-2025-23266) that a
runtime handler `vgpu` names in `base_runtime_spec`.

The `vgpu` handler is a deep copy of the node's NVIDIA handler (`runtime_type`,
`options` with `BinaryName`, `SystemdCgroup`, everything): the GPU still reaches
the container through nvidia-container-runtime, our hook adds the vGPU slice.
`node_setup.nodetype` decides which handler and which binary (docs/operators/install.md).

- containerd 1.6/1.7 (config `version = 2`): the file that owns the effective
  CRI section is edited in place with tomlkit (comments and every other setting
  preserved): the main config.toml, or - when a drop-in such as the toolkit's
  conf.d/99-nvidia.toml carries the CRI section - that drop-in (see `handler.target_v2`).
  Originals are backed up next to each file, and a sidecar records what install
  wrote, so uninstall restores every file byte for byte (or, if the admin
  edited one since, removes only our keys).
- containerd 2.x (config `version = 3`): a drop-in `<conf.d>/vgpu.toml` (2.x
  deep-merges drop-ins); the main config gets an `imports` entry if it lacks one.

With `--root DIR` every file is read and written under DIR (the host's `/` as an
installer container sees it), while every path written *into* a file (hook,
interpreter, base spec, BinaryName) is the host's.

One module per job: `spec` (the base runtime spec: containerd's default plus our hooks),
`handler` (the vgpu handler's table, from the node facts), `tomledit` (the config file edits),
`plan` (what install and uninstall would write, given the facts, the options and what the host's
files hold: data, no I/O), `apply` (reads the host, writes the plan, backups and the sidecar).
The command (`vgpu-hook containerd ...`, argparse -> `plan.Options`) is node_setup.hookcmd.
"""
