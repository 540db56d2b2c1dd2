"""The hook as a runtime starts it: the command line (the host's python3 running
runtime_hook/fastpath.py with -I -S, every hook setting in its flags), the POSIX sh filter in
front of it, and the hook objects `containerd install` puts in the base runtime spec and
`hooksd install` in hooks.d entries (each with an explicit `env` and `timeout`: a hook without
`env` may inherit the image's environment, CVE-2025-23266).  Pure."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
MARK = "vgpu-hook"
CDI_DEFAULT_PREFIX = "cdi.k8s.io/"


def default_hook_path() -> str:
    """runtime_hook/fastpath.py of the installation this command runs from."""
    import runtime_hook

    return os.path.join(os.path.dirname(os.path.abspath(runtime_hook.__file__)), "fastpath.py")


def hook_command(python: str, kind: str, global_args: list[str], hook_path: str | None = None) -> list[str]:
    fast = hook_path or default_hook_path()
    # -I: no PYTHON* env, no user site, no cwd on sys.path; -S: no site scan on the hot path.
    return [python, "-I", "-S", fast, *global_args, kind]


def hook_args(config_path: str | None, cfg: Any) -> list[str]:
    """The hook's flags: every hook setting of the resolved node config (file + flags), and the
    config file's path (`config_path`, None when none was named).

    The hook then never parses the TOML file on a container's start; re-run
    `containerd install` after changing the config (the packages' postinst does).
    """
    out: list[str] = []
    if config_path:
        out += ["--config", os.path.abspath(config_path)]
    out += [
        "--state-dir", os.path.abspath(cfg.common.state_dir),
        "--library-path", os.path.abspath(cfg.hook.library_path),
        "--log-dir", os.path.abspath(cfg.hook.log_dir),
        "--log-level", str(cfg.common.log_level),
        "--log-max-bytes", str(cfg.hook.log_max_bytes),
    ]  # fmt: skip
    prefix = cfg.device_plugin.cdi_annotation_prefix
    if prefix != CDI_DEFAULT_PREFIX:
        # The hook checks CDI annotations under this prefix too (the device plugin's, which the
        # node's NVIDIA runtime is then configured to honour), without parsing the TOML file.
        out += ["--cdi-annotation-prefix", prefix]
    return out


# The installed hook is this POSIX sh filter in front of the Python hook.  It
# only ever decides "no token, nothing to do" (exit 0), and only when neither
# token name appears in the raw state line, and config.json holds no env
# entry `"VGPU_ALLOCATION_TOKEN=`, no key ending `allocation-token"` and no
# JSON \u escape of a character that could spell one (letters, digits, -./=;
# Go's encoder escapes only <>& and control characters); everything else - tokens, odd input,
# grep errors - goes to Python with the state re-fed on stdin.  A no-token
# container then costs one sh and one grep (~2 ms) instead of an interpreter.
# poststop removes a vGPU container's state dir itself (`rm -rf`, the id
# checked against the container-id charset); only a failure goes to Python,
# which logs it.
#
# The script itself is part of config.json (it is in the spec's hooks), so the
# grep patterns are assembled at run time and never appear literally in it,
# and it contains no `&`, `<` or `>`, which Go's JSON encoder (containerd)
# writes as \u0026, \u003c, \u003e.  test_containerd_install checks both.
SHELL_FILTER = r"""s=; IFS= read -r s
case $1 in
prestart)
  case $s in *vgpu.k8s.io/allocation-token*|*VGPU_ALLOCATION_TOKEN*) ;; *)
    b=${s#*\"bundle\":\"}
    if [ "$b" != "$s" ]; then
      b=${b%%\"*}
      case $b in /*\\*|/*\"*) ;; /*)
        if [ -f "$b/config.json" ]; then
          v=VGPU_ALLOCATION a=allocation e='\' x='(2[d-fD-F]|3[0-9dD]|[4-7][0-9a-fA-F])'
          grep -q -E -e "\"${v}_TOKEN=" -e "${a}-token\"" -e "$e${e}u00$x" "$b/config.json"
          if [ $? -eq 1 ]; then exit 0; fi
        fi;;
      esac
    fi;;
  esac;;
poststop)
  i=${s#*\"id\":\"}
  if [ "$i" != "$s" ]; then
    i=${i%%\"*}
    case $i in ""|.|..|*[!A-Za-z0-9_+.-]*) ;; *)
      d=$VGPU_STATE/containers/$i
      if [ ! -e "$d" ]; then exit 0; fi
      if rm -rf -- "$d"; then exit 0; fi;;
    esac
  fi;;
esac
shift
{ printf '%s\n' "$s"; exec cat; } | exec "$@"
"""


def shell_filter(state_dir: str) -> str:
    return f"VGPU_STATE={shlex.quote(state_dir)}\n{SHELL_FILTER}"


def hook_entries(
    python: str, global_args: list[str], timeout: int, state_dir: str | None = None, hook_path: str | None = None
) -> dict[str, dict[str, Any]]:
    """Hook objects for the spec: the sh filter (when state_dir is given) or Python directly."""
    out = {}
    for kind in ("prestart", "poststop"):
        args = hook_command(python, kind, global_args, hook_path)
        if state_dir is not None:
            args = ["/bin/sh", "-c", shell_filter(state_dir), "vgpu-hook", kind, *args]
        out[kind] = {"path": args[0], "args": args, "env": list(HOOK_ENV), "timeout": timeout}
    return out


def is_ours(hook: Any) -> bool:
    args = hook.get("args") if isinstance(hook, dict) else None
    if not isinstance(args, list):
        return False
    if len(args) > 3 and args[:2] == ["/bin/sh", "-c"] and args[3] == MARK:
        return True  # the sh filter form
    return any(isinstance(a, str) and a.endswith("/fastpath.py") for a in args)


@dataclass(frozen=True)
class HookOptions:
    """How the runtime starts the hook (host paths: runc runs it on the host)."""

    python: str  # the host's interpreter, absolute
    hook_path: str | None = None  # runtime_hook/fastpath.py on the host (None: this installation's)
    timeout: int = 30  # seconds the runtime allows each hook
    # The state dir the sh filter removes poststop directories from (fixed at install time: it
    # runs without parsing TOML; re-run install after changing common.state_dir); None: no
    # filter, Python for every container.
    filter_state_dir: str | None = None
    args: tuple[str, ...] = ()  # the hook's flags (hook_args)

    def entries(self) -> dict[str, dict[str, Any]]:
        return hook_entries(self.python, list(self.args), self.timeout, self.filter_state_dir, self.hook_path)


def missing_on_host(hook: HookOptions, exists: Callable[[str], bool], where: str) -> str:
    """Under --root, the paths written into a spec are the host's: ours (inside an installer
    container) may not exist there.  The first one missing under the root `where`, as a message
    ("" when none is)."""
    for what, path in (("--python", hook.python), ("--hook-path", hook.hook_path or default_hook_path())):
        if not exists(path):
            return f"{path} does not exist under --root {where}: pass {what} with the host's path"
    return ""
