"""The hook's entry point, built to be cheap for containers without a vGPU.

Installed hooks run `python3 -I -S <site-packages>/runtime_hook/fastpath.py
--config ... prestart`: no site-packages scan, no user environment, only
built-in modules until a container turns out to carry an allocation token.
Then site-packages is appended and the full command line (runtime_hook.cli)
takes over with the decision already made, so stdin is read exactly once.

fastpath.py is only a shim that imports this module: a script run by path is
compiled on every start (~1-2 ms for this file), a module comes from its .pyc.

`vgpu-hook` (the console script) and `python -m runtime_hook` enter here too.
"""

from __future__ import annotations

import os
import sys

from runtime_hook import oci  # stdlib-only module

DEFAULT_STATE_DIR = "/var/lib/vgpu"  # == vgpu.paths.DEFAULT_STATE_DIR (checked by a test)
DEFAULT_CONFIG_PATH = "/etc/vgpu/config.toml"
DEFAULT_LIBRARY_PATH = "/usr/lib/vgpu/libvgpu.so"  # == vgpu.paths.DEFAULT_LIBRARY_PATH
DEFAULT_LOG_DIR = "/var/log/vgpu"  # == vgpu.paths.DEFAULT_LOG_DIR
_VALUE_OPTS = (
    "--config",
    "--state-dir",
    "--log-level",
    "--library-path",
    "--log-dir",
    "--log-max-bytes",
    "--cdi-annotation-prefix",
)


def scan_argv(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """The subcommand and the global options given before it (no argparse on the hot path)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name in _VALUE_OPTS:
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


def fast_state_dir(opts: dict[str, str]) -> str | None:
    """The state dir when it can be known without parsing TOML, else None."""
    if "--state-dir" in opts:
        return opts["--state-dir"]
    path = opts.get("--config") or os.environ.get("VGPU_CONFIG") or DEFAULT_CONFIG_PATH
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        return DEFAULT_STATE_DIR
    except OSError:
        return None
    return None if b"state_dir" in data else DEFAULT_STATE_DIR


def _read_stdin() -> bytes:
    try:
        return sys.stdin.buffer.read(oci.MAX_STATE_BYTES + 1)
    except (OSError, ValueError, AttributeError):
        return b""


def _enable_site_packages() -> None:
    """Started with -S: make site-packages (msgspec, tomlkit) importable, cheaply.

    Only what needs them calls this: the full command line, and a hook that must parse the node
    config (cli.hook_config without every setting in its flags).  The hook paths themselves are
    stdlib only; the host python's `site.main()` alone costs ~6 ms (dist-packages, .pth files).

    In a virtualenv, append its site-packages directly: `site.main()` would
    also run every .pth file (setuptools' editable-install finder alone costs
    ~10 ms).  The package root is already first on sys.path.
    """
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


def _full(argv: list[str], **kw: object) -> int:
    if not kw:  # not a hook invocation: argparse, vgpu.config, containerd install...
        _enable_site_packages()
    from runtime_hook import cli

    return cli.main(argv, **kw)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cmd, opts = scan_argv(args)
    if cmd not in ("prestart", "poststop"):
        return _full(args)
    try:
        return _hook(cmd, args, opts)
    except Exception as e:  # a bug: one line, never a bare traceback; fail closed only for vGPU containers
        sys.stderr.write(f"vgpu-hook: internal error in {cmd}: {type(e).__name__}: {oci.oneline(str(e))}\n")
        return 1 if cmd == "prestart" and _seen_token else 0


_seen_token = True  # until stdin has been read and shows no token marker


def _hook(cmd: str, args: list[str], opts: dict[str, str]) -> int:
    global _seen_token
    if cmd == "prestart":
        data = _read_stdin()
        _seen_token = oci.mentions_token(data)
        decision = oci.decide_prestart(data)
        if isinstance(decision, oci.Skip) and decision.log is None:
            return 0  # no token: the common case, untouched
        return _full(args, decision=decision)
    if cmd == "poststop":
        data = _read_stdin()
        try:
            cid = oci.parse_poststop_id(data)
        except ValueError:
            return _full(args, poststop_stdin=data)
        state_dir = fast_state_dir(opts)
        if state_dir is not None and not os.path.lexists(os.path.join(state_dir, "containers", cid)):
            return 0  # not a vGPU container (or already cleaned)
        return _full(args, poststop_stdin=data)
    return _full(args)  # pragma: no cover - cmd is prestart or poststop


def exit_now(rc: int) -> None:
    """End a hook invocation without the interpreter's teardown.

    Finalising modules and the GC costs a vGPU prestart ~4 ms (ctypes is
    loaded).  Safe here: the hook writes its files and log through os-level
    fds it closes itself and waits for its child; only stdout/stderr are
    buffered, so flush them first.
    """
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(rc)
