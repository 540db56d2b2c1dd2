"""`vgpu-hook hooksd install | uninstall | print`: OCI hooks.d entries for CRI-O and podman.

CRI-O and podman read hook definitions from hooks.d directories (schema 1.0.0 of
containers/common `pkg/hooks`, docs/containers-hooks.5): one JSON file per hook, injected
into a container's spec when its `when` conditions match.  We write two:

- `vgpu.json`: the prestart hook, `when.annotations` on our token annotation
  (`vgpu.k8s.io/allocation-token`), so only containers carrying a token get it;
- `vgpu-poststop.json`: the poststop hook (removes the per-container state), same condition.

Each hook has an explicit `env` (PATH only: a hook must never inherit the image's env,
CVE-2025-23266) and a `timeout`.  The commands are exactly the ones `containerd install`
puts in the base runtime spec (node_setup.hookspec: the sh filter in front of
`python -I -S fastpath.py`).

`plan` decides the files (pure), `apply` writes or removes them; the command (argparse ->
`plan.Options`) is node_setup.hookcmd.
"""
