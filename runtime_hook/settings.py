"""The hook's settings: its flags, the node config, and the defaults of both.

The installed hook runs `python3 -I -S .../runtime_hook/fastpath.py <flags> prestart|poststop`
with every setting in its flags (`vgpu-hook containerd install` writes them), so the config file
is not read and nothing outside the standard library is imported. Without every setting in the
flags and with a config file, the node config is read through vgpu.config (msgspec and a TOML
parser: site-packages are enabled for it).
"""

from __future__ import annotations

import os
import sys

from runtime_hook import hooklog
from runtime_hook.oci import CDI_ANNOTATION_PREFIX
from vgpu import paths as vpaths

TYPE_CHECKING = False  # `typing` (~3 ms) is not imported on the hook paths
if TYPE_CHECKING:
    from typing import Any

# Flags that set a config field (the rest of the node config is not the hook's).
FLAG_KEYS = {
    "--state-dir": "common.state_dir",
    "--log-level": "common.log_level",
    "--library-path": "hook.library_path",
    "--log-dir": "hook.log_dir",
    "--log-max-bytes": "hook.log_max_bytes",
}
VALUE_OPTS = ("--config", *FLAG_KEYS, "--cdi-annotation-prefix")


def scan_argv(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """The subcommand and the options given before it (no argparse on the hot path)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name in VALUE_OPTS:
                if not eq:
                    if i + 1 >= len(argv):
                        return None, opts
                    i += 1
                    val = argv[i]
                opts[name] = val
            i += 1
            continue
        if a.startswith("-"):
            return None, opts
        return a, opts
    return None, opts


def config_path(opts: dict[str, str]) -> str:
    return opts.get("--config") or os.environ.get("VGPU_CONFIG") or vpaths.DEFAULT_CONFIG_PATH


def fast_state_dir(opts: dict[str, str]) -> str | None:
    """The state dir when it can be known without parsing TOML, else None."""
    if "--state-dir" in opts:
        return opts["--state-dir"]
    try:
        with open(config_path(opts), "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        return vpaths.DEFAULT_STATE_DIR
    except OSError:
        return None
    return None if b"state_dir" in data else vpaths.DEFAULT_STATE_DIR


class _Section:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FlagConfig:
    """The hook's part of the node config, from flags and defaults (no config file to read)."""

    def __init__(self, opts: dict[str, str]) -> None:
        level = opts.get("--log-level", "warning")
        if level not in hooklog.LEVELS:
            raise ValueError(f"invalid option --log-level {level!r}: expected one of debug, info, warning, error")
        raw = opts.get("--log-max-bytes", str(4 * 1024 * 1024))
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"invalid option --log-max-bytes {raw[:20]!r}: expected an integer >= 1")
        self.common = _Section(state_dir=opts.get("--state-dir", vpaths.DEFAULT_STATE_DIR), log_level=level)
        self.hook = _Section(
            library_path=opts.get("--library-path", vpaths.DEFAULT_LIBRARY_PATH),
            log_dir=opts.get("--log-dir", vpaths.DEFAULT_LOG_DIR),
            log_max_bytes=int(raw),
        )
        prefix = opts.get("--cdi-annotation-prefix", CDI_ANNOTATION_PREFIX)
        if not valid_cdi_prefix(prefix):
            raise ValueError(f"invalid option --cdi-annotation-prefix {prefix[:40]!r}: expected e.g. 'cdi.k8s.io/'")
        self.device_plugin = _Section(cdi_annotation_prefix=prefix)


def valid_cdi_prefix(p: str) -> bool:
    """vgpu.config's pattern for cdi_annotation_prefix, without `re` on the hook's path."""
    head = p[:-1]
    return (
        p.endswith("/")
        and bool(head)
        and head[0].isascii()
        and head[0].isalnum()
        and all(c.isascii() and (c.islower() or c.isdigit() or c in ".-") for c in head)
    )


def enable_site_packages() -> None:
    """Started with -S: make site-packages (msgspec, tomlkit) importable, cheaply.

    Only reading the node config needs them. In a virtualenv, its site-packages is appended
    directly: `site.main()` would also run every .pth file (setuptools' editable-install finder
    alone costs ~10 ms; the host python's dist-packages ~6 ms)."""
    if "site" in sys.modules:
        return
    venv = os.path.dirname(os.path.dirname(sys.executable))
    sp = os.path.join(venv, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")) and os.path.isdir(sp):
        if sp not in sys.path:
            sys.path.append(sp)
        return
    import site

    site.main()


def load_config(path: str, overrides: dict[str, Any]) -> Any:
    """The node config (vgpu.config.NodeConfig) with flag overrides; ValueError when invalid."""
    enable_site_packages()
    from vgpu import config as vconfig

    return vconfig.load_config(path, overrides)


def hook_config(opts: dict[str, str]) -> Any:
    """Flags only when they give every hook setting or there is no config file; else the node config."""
    path = config_path(opts)
    if all(f in opts for f in FLAG_KEYS) or not os.path.exists(path):
        return FlagConfig(opts)
    return load_config(path, {key: opts.get(flag) for flag, key in FLAG_KEYS.items()})
