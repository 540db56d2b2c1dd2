"""`vgpu-hook prestart|poststop`: the hook's one entry, built to be cheap for containers without a vGPU.

Installed hooks run `python3 -I -S <prefix>/runtime_hook/fastpath.py <flags> prestart|poststop`:
no site-packages, no user environment, only the standard library. The command line is scanned
once (settings.scan_argv), stdin read once, and a container without an allocation token leaves
after a byte search and one JSON decode (oci.decide_prestart). Exit codes: 0 ok / container left
alone, 1 the container must not start (one line on stderr), 2 usage.
"""

from __future__ import annotations

import os
import sys

from runtime_hook import hooklog, oci, settings
from vgpu.log import kv

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

USAGE = (
    "usage: vgpu-hook [--config F] [--state-dir D] [--log-level L] [--library-path P] [--log-dir D]"
    " [--log-max-bytes N] [--cdi-annotation-prefix P] prestart|poststop"
)


def _read_stdin() -> bytes:
    try:
        return sys.stdin.buffer.read(oci.MAX_STATE_BYTES + 1)
    except (OSError, ValueError, AttributeError):
        return b""


def _fatal(msg: str) -> int:
    line = "vgpu-hook: " + oci.oneline(msg, 2000)
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    hooklog.log.error(line)
    return 1


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"vgpu-hook: {oci.oneline(msg)}\n")
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cmd, opts = settings.scan_argv(args)
    return run(args, cmd, opts)


def run(args: list[str], cmd: str | None, opts: dict[str, str]) -> int:
    """The hook for a command line already scanned (`cmd`, `opts`: settings.scan_argv of `args`)."""
    if cmd not in ("prestart", "poststop") or "-h" in args or "--help" in args:
        _say(USAGE if cmd in (None, "prestart", "poststop") else f"unknown command {cmd!r}; {USAGE}")
        return 2
    data = _read_stdin()
    try:
        if cmd == "prestart":
            return prestart(opts, oci.decide_prestart(data))
        return poststop(opts, data)
    except Exception as e:  # a bug: one line, never a bare traceback; fail closed only for vGPU containers
        _say(f"internal error in {cmd}: {type(e).__name__}: {e}")
        return 1 if cmd == "prestart" and oci.mentions_token(data) else 0


def _config(opts: dict[str, str], fail_closed: bool) -> Any | None:
    """The settings, with the log set up; None (and the reason said) when they are invalid."""
    try:
        cfg = settings.hook_config(opts)
    except ValueError as e:  # vgpu.config.ConfigError is a ValueError
        if fail_closed:
            _fatal(str(e))  # a vGPU container cannot be set up without its config
        else:
            _say(str(e))  # a broken node config never blocks other containers, nor deletion
        return None
    hooklog.log = hooklog.HookLog(cfg.hook.log_dir, cfg.hook.log_max_bytes, cfg.common.log_level)
    return cfg


def prestart(opts: dict[str, str], decision: oci.Proceed | oci.Skip | oci.Fail) -> int:
    if isinstance(decision, oci.Skip) and decision.log is None:
        return 0  # no token: the common case, untouched
    cfg = _config(opts, fail_closed=not isinstance(decision, oci.Skip))
    if cfg is None:
        return 0 if isinstance(decision, oci.Skip) else 1
    if isinstance(decision, oci.Skip):
        hooklog.log.warning(kv("prestart: container left alone", reason=decision.log))
        return 0
    if isinstance(decision, oci.Fail):
        return _fatal(decision.message)
    from runtime_hook import prestart as setup

    try:
        prefixes = tuple(dict.fromkeys((settings.CDI_ANNOTATION_PREFIX, cfg.device_plugin.cdi_annotation_prefix)))
        setup.run(decision, cfg.common.state_dir, cfg.hook.library_path, prefixes)
    except oci.HookError as e:
        return _fatal(str(e))
    except Exception as e:  # a bug must still fail closed with one line, never only a traceback
        hooklog.log.error(kv("prestart failed", error=repr(e)))
        return _fatal(f"internal error setting up vGPU container: {type(e).__name__}: {e}")
    return 0


def poststop(opts: dict[str, str], data: bytes) -> int:
    try:
        cid = oci.parse_poststop_id(data)
    except ValueError as e:
        if _config(opts, fail_closed=False) is not None:
            hooklog.log.warning(kv("poststop: malformed OCI state", reason=str(e)))
        return 0
    state_dir = settings.fast_state_dir(opts)
    if state_dir is not None and not os.path.lexists(os.path.join(state_dir, "containers", cid)):
        return 0  # not a vGPU container (or already cleaned)
    cfg = _config(opts, fail_closed=False)
    if cfg is None:
        return 0
    from runtime_hook import poststop as cleanup

    try:
        cleanup.remove_state(cid, cfg.common.state_dir)
    except Exception as e:
        hooklog.log.error(kv("poststop failed", error=repr(e)))
    return 0


def exit_now(rc: int) -> None:
    """End a hook invocation without the interpreter's teardown (finalising modules and the GC
    cost a vGPU prestart ~4 ms). Safe here: the hook writes its files and log through os-level
    fds it closes itself and waits for its child; only stdout/stderr are buffered, so flush them."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(rc)
