"""`vgpu-hook containerd install | uninstall | print`: wire the hook into containerd.

The hook travels in a base runtime spec (containerd's default spec plus our
prestart and poststop hooks, each with an explicit `env` and `timeout`: a hook
without `env` may inherit the image's environment, CVE-2025-23266) that a
runtime handler `vgpu` (runc v2) names in `base_runtime_spec`.

- containerd 1.6/1.7 (config `version = 2`): the main config.toml is edited in
  place with tomlkit (comments and every other setting preserved).  A drop-in
  under `imports` is NOT safe there: a drop-in touching the CRI plugin replaces
  the whole CRI section.  The original file is backed up next to it, and a
  sidecar records what install wrote, so uninstall restores the original byte
  for byte (or, if the admin edited the file since, removes only our keys).
- containerd 2.x (config `version = 3`): a drop-in `<conf.d>/vgpu.toml` (2.x
  deep-merges drop-ins); the main config gets an `imports` entry if it lacks one.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from typing import Any

import tomlkit
from tomlkit.items import Table

V2_CRI = "io.containerd.grpc.v1.cri"
V3_RUNTIME = "io.containerd.cri.v1.runtime"
HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
MARK = "vgpu-hook"
ANNOTATION_GLOB = "vgpu.k8s.io/*"


class InstallError(Exception):
    pass


# ---- the base runtime spec ----------------------------------------------------


def hook_command(python: str, kind: str, global_args: list[str]) -> list[str]:
    fast = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastpath.py")
    # -I: no PYTHON* env, no user site, no cwd on sys.path; -S: no site scan on the hot path.
    return [python, "-I", "-S", fast, *global_args, kind]


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
    python: str, global_args: list[str], timeout: int, state_dir: str | None = None
) -> dict[str, dict[str, Any]]:
    """Hook objects for the spec: the sh filter (when state_dir is given) or Python directly."""
    out = {}
    for kind in ("prestart", "poststop"):
        args = hook_command(python, kind, global_args)
        if state_dir is not None:
            args = ["/bin/sh", "-c", shell_filter(state_dir), "vgpu-hook", kind, *args]
        out[kind] = {"path": args[0], "args": args, "env": list(HOOK_ENV), "timeout": timeout}
    return out


def _is_ours(hook: Any) -> bool:
    args = hook.get("args") if isinstance(hook, dict) else None
    return isinstance(args, list) and any(isinstance(a, str) and a.endswith("runtime_hook/fastpath.py") for a in args)


def default_spec(source: str | None) -> dict[str, Any]:
    if source:
        try:
            with open(source, "rb") as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            raise InstallError(f"cannot read base spec {source}: {e}") from None
    else:
        ctr = shutil.which("ctr")
        if not ctr:
            raise InstallError("`ctr` not found: pass --base-spec-source with containerd's default spec")
        r = subprocess.run([ctr, "oci", "spec"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise InstallError(f"`ctr oci spec` failed: {r.stderr.strip()[:200]}")
        spec = json.loads(r.stdout)
    if not isinstance(spec, dict):
        raise InstallError("base spec is not a JSON object")
    return spec


def with_hooks(spec: dict[str, Any], entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))
    hooks = spec.setdefault("hooks", {})
    for kind, entry in entries.items():
        lst = [h for h in hooks.get(kind) or [] if not _is_ours(h)]
        lst.append(entry)
        hooks[kind] = lst
    return spec


# ---- config editing -----------------------------------------------------------


def _table(parent: Any, key: str) -> Any:
    if key not in parent:
        parent[key] = tomlkit.table()
    return parent[key]


def _runtimes_v2(doc: Any) -> Any:
    cri = _table(_table(doc, "plugins"), V2_CRI)
    return _table(cri, "containerd")


def edit_v2(text: str, handler: str, base_spec: str, make_default: bool) -> str:
    """containerd 1.x config (version 2): add runtimes.<handler>, optionally the default."""
    doc = tomlkit.parse(text)
    if doc.get("version", 1) not in (2,):
        raise InstallError(f"containerd 1.x config version {doc.get('version', 1)} unsupported (need version = 2)")
    ctd = _runtimes_v2(doc)
    runtimes = _table(ctd, "runtimes")
    rt = tomlkit.table()
    rt.add(tomlkit.comment(f"added by {MARK}: OCI hooks for vGPU containers"))
    rt["runtime_type"] = "io.containerd.runc.v2"
    rt["base_runtime_spec"] = base_spec
    # CRI passes container annotations (the device plugin's token) into the
    # OCI spec only for the keys a runtime lists.
    rt["container_annotations"] = [ANNOTATION_GLOB]
    base_opts = runtimes.get("runc", {}).get("options") if "runc" in runtimes else None
    opts = tomlkit.table()
    if isinstance(base_opts, dict):
        for k, v in base_opts.items():
            opts[k] = v.unwrap() if hasattr(v, "unwrap") else v
    rt["options"] = opts
    runtimes[handler] = rt
    if make_default:
        ctd["default_runtime_name"] = handler
    return tomlkit.dumps(doc)


def remove_v2(text: str, handler: str, previous_default: str | None) -> str:
    doc = tomlkit.parse(text)
    try:
        ctd = doc["plugins"][V2_CRI]["containerd"]  # type: ignore[index]
    except KeyError:
        return text
    runtimes = ctd.get("runtimes")
    if isinstance(runtimes, Table) and handler in runtimes:
        del runtimes[handler]
    if ctd.get("default_runtime_name") == handler:
        ctd["default_runtime_name"] = previous_default or "runc"
    return tomlkit.dumps(doc)


def dropin_v3(handler: str, base_spec: str, make_default: bool) -> str:
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"written by {MARK}; removed by `vgpu-hook containerd uninstall`"))
    doc["version"] = 3
    rt_parent = tomlkit.table(is_super_table=True)
    ctd = tomlkit.table(is_super_table=not make_default)
    if make_default:
        ctd["default_runtime_name"] = handler
    rts = tomlkit.table(is_super_table=True)
    rt = tomlkit.table()
    rt["runtime_type"] = "io.containerd.runc.v2"
    rt["base_runtime_spec"] = base_spec
    rt["container_annotations"] = [ANNOTATION_GLOB]
    rts[handler] = rt
    ctd["runtimes"] = rts
    rt_parent["containerd"] = ctd
    plugins = tomlkit.table(is_super_table=True)
    plugins[V3_RUNTIME] = rt_parent
    doc["plugins"] = plugins
    return tomlkit.dumps(doc)


def ensure_import(text: str, pattern: str) -> str:
    doc = tomlkit.parse(text)
    if doc.get("version", 1) != 3:
        raise InstallError("containerd 2.x needs config `version = 3` (run `containerd config migrate`)")
    imports = doc.get("imports")
    if imports is None:
        arr = tomlkit.array()
        arr.append(pattern)
        doc["imports"] = arr  # tomlkit places a plain key before the first table
    elif pattern not in list(imports):
        imports.append(pattern)
    return tomlkit.dumps(doc)


# ---- install / uninstall ------------------------------------------------------


def detect_major(explicit: str | None, config_text: str | None) -> int:
    if explicit:
        if explicit not in ("1", "2"):
            raise InstallError(f"--containerd-version must be 1 or 2, not {explicit!r}")
        return int(explicit)
    if config_text:
        try:
            v = tomlkit.parse(config_text).get("version", 1)
        except Exception as e:
            raise InstallError(f"cannot parse containerd config: {e}") from None
        if v == 3:
            return 2
    exe = shutil.which("containerd")
    if exe:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
        for word in r.stdout.split():
            if word[:1].isdigit() or word[:2] in ("v1", "v2"):
                return 2 if word.lstrip("v").startswith("2") else 1
    return 1


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InstallError(f"cannot read {path}: {e.strerror}") from None


def _write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{MARK}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _sha(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def _default_config_text() -> str:
    exe = shutil.which("containerd")
    if exe:
        r = subprocess.run([exe, "config", "default"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout
    return "version = 2\n"


class Plan:
    """What install would write: {path: new text}, plus the sidecar state."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}
        self.old: dict[str, str | None] = {}


def resolved_args(args: argparse.Namespace, cfg: Any) -> list[str]:
    """The hook's flags: every hook setting of the resolved node config (file + flags).

    The hook then never parses the TOML file on a container's start; re-run
    `containerd install` after changing the config (the packages' postinst does).
    """
    out: list[str] = []
    cfg_path = args.config or os.environ.get("VGPU_CONFIG")
    if cfg_path:
        out += ["--config", os.path.abspath(cfg_path)]
    out += [
        "--state-dir", os.path.abspath(cfg.common.state_dir),
        "--library-path", os.path.abspath(cfg.hook.library_path),
        "--log-dir", os.path.abspath(cfg.hook.log_dir),
        "--log-level", str(cfg.common.log_level),
        "--log-max-bytes", str(cfg.hook.log_max_bytes),
    ]  # fmt: skip
    return out


def plan_install(args: argparse.Namespace, cfg: Any) -> tuple[Plan, dict[str, Any]]:
    conf = os.path.abspath(args.containerd_config)
    text = _read(conf)
    major = detect_major(args.containerd_version, text)
    base_spec = os.path.abspath(args.base_spec or os.path.join(os.path.dirname(conf), "vgpu-base-spec.json"))
    python = os.path.abspath(args.python or sys.executable)
    # The state dir is fixed at install time (the sh filter needs it without
    # parsing TOML): re-run install after changing common.state_dir.
    state_dir = os.path.abspath(cfg.common.state_dir)
    gargs = resolved_args(args, cfg)
    entries = hook_entries(python, gargs, args.hook_timeout, None if args.no_shell_filter else state_dir)
    spec = with_hooks(default_spec(args.base_spec_source), entries)
    plan = Plan()
    plan.files[base_spec] = json.dumps(spec, indent=2) + "\n"
    state: dict[str, Any] = {"major": major, "handler": args.handler, "base_spec": base_spec, "config": conf}
    side = _sidecar(conf)
    prev = _load_sidecar(side)
    original = prev["original"] if prev else text
    if major == 1:
        start = text if text is not None else _default_config_text()
        try:
            ctd = tomlkit.parse(start).get("plugins", {}).get(V2_CRI, {}).get("containerd", {})
        except Exception as e:
            raise InstallError(f"cannot parse {conf}: {e}") from None
        prev_default = prev["previous_default"] if prev else ctd.get("default_runtime_name")
        if prev_default == args.handler:
            prev_default = "runc"
        new = edit_v2(start, args.handler, base_spec, args.default)
        plan.files[conf] = new
        state["previous_default"] = prev_default
    else:
        confd = os.path.abspath(args.conf_d or os.path.join(os.path.dirname(conf), "conf.d"))
        dropin = os.path.join(confd, "vgpu.toml")
        plan.files[dropin] = dropin_v3(args.handler, base_spec, args.default)
        state["dropin"] = dropin
        start = text if text is not None else "version = 3\n"
        plan.files[conf] = ensure_import(start, os.path.join(confd, "*.toml"))
    for path in plan.files:
        plan.old[path] = _read(path)
    state["original"] = original
    state["installed_sha256"] = _sha(plan.files[conf])
    return plan, state


def _sidecar(conf: str) -> str:
    return conf + f".{MARK}.json"


def _load_sidecar(path: str) -> dict[str, Any] | None:
    t = _read(path)
    if t is None:
        return None
    try:
        d = json.loads(t)
    except ValueError:
        raise InstallError(f"{path} is corrupt; remove it to start over") from None
    return d if isinstance(d, dict) else None


def install(args: argparse.Namespace, cfg: Any) -> int:
    plan, state = plan_install(args, cfg)
    conf = state["config"]
    side = _sidecar(conf)
    if _load_sidecar(side) is None:
        if state["original"] is not None:
            _write(conf + f".{MARK}.bak", state["original"], 0o600)
        _write(side, json.dumps(state, indent=2) + "\n", 0o600)
    else:
        prev = _load_sidecar(side) or {}
        prev.update({k: v for k, v in state.items() if k != "original"})
        _write(side, json.dumps(prev, indent=2) + "\n", 0o600)
    for path, text in plan.files.items():
        if plan.old.get(path) != text:
            _write(path, text)
    sys.stdout.write(
        f"vgpu-hook: containerd {state['major']}.x configured (handler `{args.handler}`); restart containerd\n"
    )
    return 0


def uninstall(args: argparse.Namespace) -> int:
    conf = os.path.abspath(args.containerd_config)
    side = _sidecar(conf)
    st = _load_sidecar(side)
    if st is None:
        sys.stdout.write("vgpu-hook: nothing to uninstall\n")
        return 0
    current = _read(conf)
    original = st.get("original")
    if _sha(current) == st.get("installed_sha256"):
        if original is None:
            os.unlink(conf)
        else:
            _write(conf, original)
    elif current is not None and st.get("major") == 1:
        _write(conf, remove_v2(current, st.get("handler", "vgpu"), st.get("previous_default")))
    # (2.x: an edited main config keeps its harmless `imports` entry.)
    for path in (st.get("dropin"), st.get("base_spec")):
        if path and os.path.exists(path):
            os.unlink(path)
    bak = conf + f".{MARK}.bak"
    if os.path.exists(bak):
        os.unlink(bak)
    os.unlink(side)
    sys.stdout.write("vgpu-hook: containerd configuration restored; restart containerd\n")
    return 0


def show(args: argparse.Namespace, cfg: Any) -> int:
    plan, _ = plan_install(args, cfg)
    out = sys.stdout
    for path, text in plan.files.items():
        old = plan.old.get(path)
        if old == text:
            out.write(f"# {path}: unchanged\n")
            continue
        diff = difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=path if old is not None else "/dev/null",
            tofile=path,
        )
        out.writelines(diff)
    return 0


def command(args: argparse.Namespace, cfg: Any) -> int:
    if args.action == "install":
        return install(args, cfg)
    if args.action == "uninstall":
        return uninstall(args)
    return show(args, cfg)
