"""Test helpers for the simulated NVIDIA container toolkit (sim/fakegpu/toolkit/).

The programs themselves are built into build/fakegpu/ (`make build-all`):
`nvidia-container-runtime` (+ `.legacy`, `.cdi`), `nvidia-container-runtime-hook`, `fakegpu-cdi`.
These helpers write their inputs so tests never hand-write them:

    cfg = write_toolkit_config(tmp / "config.toml", gpu, mode="legacy", spec_dirs=[tmp / "cdi"])
    spec = write_cdi_spec(tmp / "cdi", gpu)              # runs the real generator
    env = {**os.environ, "NVIDIA_CTK_CONFIG_FILE_PATH": str(cfg)}   # e.g. containerd's env
    root = operator_root(tmp, gpu)                       # GPU Operator layout, wrappers + config

docs/developers/simulators.md "The simulated container toolkit" describes what they do.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from sim.fakegpu.harness import FakeGPU

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "fakegpu"
RUNTIME = BUILD / "nvidia-container-runtime"
RUNTIME_LEGACY = BUILD / "nvidia-container-runtime.legacy"
RUNTIME_CDI = BUILD / "nvidia-container-runtime.cdi"
HOOK = BUILD / "nvidia-container-runtime-hook"
CDI_GENERATOR = BUILD / "fakegpu-cdi"
DEFAULT_KIND = "nvidia.com/gpu"
VOLUME_ROOT = "/var/run/nvidia-container-devices"
OPERATOR_TOOLKIT = "usr/local/nvidia/toolkit"
OPERATOR_BINARIES = (
    "nvidia-container-runtime",
    "nvidia-container-runtime.cdi",
    "nvidia-container-runtime.legacy",
    "nvidia-container-runtime-hook",
)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a TOML basic string is a JSON string


def toolkit_config_text(
    gpu: FakeGPU | None = None,
    *,
    mode: str = "auto",
    runtimes: list[str] | None = None,
    default_kind: str | None = None,
    annotation_prefixes: list[str] | None = None,
    spec_dirs: list[str | Path] | None = None,
    accept_envvar_unprivileged: bool | None = None,
    accept_volume_mounts: bool | None = None,
    hook_path: str | Path | None = None,
    container_lib_dir: str | None = None,
    log_level: str | None = None,
    debug: str | Path | None = None,
    skip_mode_detection: bool | None = None,
    swarm_resource: str | None = None,
    lib_dir: str | Path | None = None,
) -> str:
    """The config.toml text, keys exactly as NVIDIA's (gpu-injection.md §2.5) plus [fakegpu]."""
    top: list[str] = ["# simulated NVIDIA container toolkit (sim/fakegpu/toolkit.py)"]
    if accept_envvar_unprivileged is not None:
        top.append(
            f"accept-nvidia-visible-devices-envvar-when-unprivileged = {_toml_value(accept_envvar_unprivileged)}"
        )
    if accept_volume_mounts is not None:
        top.append(f"accept-nvidia-visible-devices-as-volume-mounts = {_toml_value(accept_volume_mounts)}")
    if swarm_resource is not None:
        top.append(f"swarm-resource = {_toml_value(swarm_resource)}")
    top += ["", "[nvidia-container-runtime]", f"mode = {_toml_value(mode)}"]
    if debug is not None:
        top.append(f"debug = {_toml_value(str(debug))}")
    if runtimes is not None:
        top.append(f"runtimes = {_toml_value(runtimes)}")
    if log_level is not None:
        top.append(f"log-level = {_toml_value(log_level)}")
    top += ["", "[nvidia-container-runtime.modes.cdi]"]
    if default_kind is not None:
        top.append(f"default-kind = {_toml_value(default_kind)}")
    if annotation_prefixes is not None:
        top.append(f"annotation-prefixes = {_toml_value(annotation_prefixes)}")
    if spec_dirs is not None:
        top.append(f"spec-dirs = {_toml_value([str(d) for d in spec_dirs])}")
    if hook_path is not None or skip_mode_detection is not None:
        top += ["", "[nvidia-container-runtime-hook]"]
        if hook_path is not None:
            top.append(f"path = {_toml_value(str(hook_path))}")
        if skip_mode_detection is not None:
            top.append(f"skip-mode-detection = {_toml_value(skip_mode_detection)}")
    return "\n".join(top) + "\n\n" + fakegpu_section(gpu, container_lib_dir=container_lib_dir, lib_dir=lib_dir)


def fakegpu_section(
    gpu: FakeGPU | None = None, *, container_lib_dir: str | None = None, lib_dir: str | Path | None = None
) -> str:
    """The stand-in's own `[fakegpu]` table (where the simulated driver is), appended to a toolkit
    config.toml - also to the exact files NVIDIA's tools wrote (tests/runtime_hook/ctrd.make_shape)."""
    top = ["[fakegpu]"]
    if gpu is not None:
        top.append(f"config = {_toml_value(str(gpu.config_path))}")
        top.append(f"state = {_toml_value(str(gpu.state_path))}")
    top.append(f"lib-dir = {_toml_value(str(lib_dir or (gpu.lib_dir if gpu is not None else BUILD)))}")
    if container_lib_dir is not None:
        top.append(f"container-lib-dir = {_toml_value(container_lib_dir)}")
    return "\n".join(top) + "\n"


def write_toolkit_config(path: str | Path, gpu: FakeGPU | None = None, **flags: Any) -> Path:
    """Writes config.toml at `path` (parents created); flags as `toolkit_config_text`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(toolkit_config_text(gpu, **flags))
    return p


def generate_cdi_spec(
    gpu: FakeGPU, *, kind: str = DEFAULT_KIND, container_lib_dir: str | None = None
) -> dict[str, Any]:
    """The spec `fakegpu-cdi` generates for this node (the real generator, run as a program)."""
    argv = [str(CDI_GENERATOR), "--config", str(gpu.config_path), "--state", str(gpu.state_path)]
    argv += ["--lib-dir", str(gpu.lib_dir), "--kind", kind]
    if container_lib_dir:
        argv += ["--container-lib-dir", container_lib_dir]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"fakegpu-cdi failed: {r.stderr.strip()}")
    spec: dict[str, Any] = json.loads(r.stdout)
    return spec


def write_cdi_spec(
    spec_dir: str | Path, gpu: FakeGPU, *, kind: str = DEFAULT_KIND, container_lib_dir: str | None = None
) -> Path:
    """Writes `<spec_dir>/<vendor>-<class>.json` for this node and returns its path."""
    d = Path(spec_dir)
    d.mkdir(parents=True, exist_ok=True)
    out = d / (kind.replace("/", "-") + ".json")
    spec = generate_cdi_spec(gpu, kind=kind, container_lib_dir=container_lib_dir)
    out.write_text(json.dumps(spec, indent=1))
    return out


def operator_root(tmp: str | Path, gpu: FakeGPU | None = None, **flags: Any) -> Path:
    """The GPU Operator's layout under `tmp`: `usr/local/nvidia/toolkit/` with shell wrappers
    that set NVIDIA_CTK_CONFIG_FILE_PATH=<toolkit>/.config/nvidia-container-runtime/config.toml
    and exec the stand-ins (nvidia-ctk-installer toolkit/installer/executables.go@v1.20.0), and
    that config (its hook path is the hook wrapper, as the installer writes).  Returns the
    toolkit directory."""
    tk = Path(tmp) / OPERATOR_TOOLKIT
    tk.mkdir(parents=True, exist_ok=True)
    cfg = tk / ".config" / "nvidia-container-runtime" / "config.toml"
    flags.setdefault("hook_path", tk / "nvidia-container-runtime-hook")
    write_toolkit_config(cfg, gpu, **flags)
    for name in OPERATOR_BINARIES:
        w = tk / name
        w.write_text(
            "#! /bin/sh\n"
            f"NVIDIA_CTK_CONFIG_FILE_PATH={_sh(str(cfg))}\n"
            "export NVIDIA_CTK_CONFIG_FILE_PATH\n"
            f'exec {_sh(str(BUILD / name))} "$@"\n'
        )
        os.chmod(w, 0o755)
    return tk


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
