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
  conf.d/99-nvidia.toml carries the CRI section - that drop-in (see `_target_v2`).
  Originals are backed up next to each file, and a sidecar records what install
  wrote, so uninstall restores every file byte for byte (or, if the admin
  edited one since, removes only our keys).
- containerd 2.x (config `version = 3`): a drop-in `<conf.d>/vgpu.toml` (2.x
  deep-merges drop-ins); the main config gets an `imports` entry if it lacks one.

With `--root DIR` every file is read and written under DIR (the host's `/` as an
installer container sees it), while every path written *into* a file (hook,
interpreter, base spec, BinaryName) is the host's.
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

from node_setup import nodetype
from node_setup.nodetype import Root

V2_CRI = "io.containerd.grpc.v1.cri"
V3_RUNTIME = "io.containerd.cri.v1.runtime"
HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
MARK = "vgpu-hook"
ANNOTATION_GLOB = "vgpu.k8s.io/*"
CDI_DEFAULT_PREFIX = "cdi.k8s.io/"


class InstallError(Exception):
    pass


# ---- the base runtime spec ----------------------------------------------------


def default_hook_path() -> str:
    """runtime_hook/fastpath.py of the installation this command runs from."""
    import runtime_hook

    return os.path.join(os.path.dirname(os.path.abspath(runtime_hook.__file__)), "fastpath.py")


def hook_command(python: str, kind: str, global_args: list[str], hook_path: str | None = None) -> list[str]:
    fast = hook_path or default_hook_path()
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


def _is_ours(hook: Any) -> bool:
    args = hook.get("args") if isinstance(hook, dict) else None
    if not isinstance(args, list):
        return False
    if len(args) > 3 and args[:2] == ["/bin/sh", "-c"] and args[3] == MARK:
        return True  # the sh filter form
    return any(isinstance(a, str) and a.endswith("/fastpath.py") for a in args)


def default_spec(source: str | None, root: Root | None = None) -> dict[str, Any]:
    """The spec to add our hooks to: `source` (a file here), else `ctr oci spec` (the host's under --root)."""
    if source:
        try:
            with open(source, "rb") as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            raise InstallError(f"cannot read base spec {source}: {e}") from None
    else:
        root = root or Root("/")
        argv: list[str] | None = None
        if root.is_host:
            ctr = shutil.which("ctr")
            argv = [ctr, "oci", "spec"] if ctr else None
        else:
            for cand in ("/usr/bin/ctr", "/usr/local/bin/ctr", "/bin/ctr"):
                if root.exists(cand):
                    argv = root.command(cand, "oci", "spec")
                    break
        if argv is None:
            raise InstallError("`ctr` not found: pass --base-spec-source with containerd's default spec")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise InstallError(f"`ctr oci spec` failed: {r.stderr.strip()[:200]}")
        spec = json.loads(r.stdout)
    if not isinstance(spec, dict):
        raise InstallError("base spec is not a JSON object")
    return spec


def without_default_security(spec: dict[str, Any]) -> dict[str, Any]:
    """containerd's default spec as CRI uses it for a handler WITHOUT base_runtime_spec.

    CRI starts such a container from the same default spec `ctr oci spec` prints, then clears
    its default rlimits (RLIMIT_NOFILE 1024), AppArmor profile and seccomp
    (pkg/cri/opts/spec_opts.go@v1.7.34 and internal/cri/opts/spec_opts.go@v2.3.4:
    WithoutDefaultSecuritySettings) - but only when the handler has no base_runtime_spec
    (container_create_linux.go: "Admins can use this functionality to define default ulimits").
    Our base spec exists only to carry the hooks, so it must not bring those defaults back: a
    vGPU container's spec equals a plain container's but for our hooks and annotations
    (recorded: containerd-cri/cri-handler-runc-base.config.json has RLIMIT_NOFILE 1024/1024, the
    handler without a base spec none)."""
    spec = json.loads(json.dumps(spec))
    proc = spec.get("process")
    if isinstance(proc, dict):
        proc.pop("rlimits", None)
        proc.pop("apparmorProfile", None)
    linux = spec.get("linux")
    if isinstance(linux, dict):
        linux.pop("seccomp", None)
    return spec


def with_hooks(spec: dict[str, Any], entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))
    hooks = spec.setdefault("hooks", {})
    for kind, entry in entries.items():
        lst = [h for h in hooks.get(kind) or [] if not _is_ours(h)]
        lst.append(entry)
        hooks[kind] = lst
    return spec


# ---- the vgpu handler ---------------------------------------------------------

NO_NVIDIA = (
    "no NVIDIA container runtime found in {where}: the vgpu handler would start containers "
    "without any GPU. Install the NVIDIA Container Toolkit and run "
    "`nvidia-ctk runtime configure --runtime=containerd` (or deploy the GPU Operator), then "
    "re-run this command; or name the runtime with --nvidia-runtime PATH; or pass "
    "--without-nvidia-runtime where the GPU reaches containers another way (simulator, tests)"
)


class Choice:
    """What the vgpu handler is built from, and why."""

    def __init__(self, table: dict[str, Any], source: str, binary: str, notes: list[str]) -> None:
        self.table = table
        self.source = source  # handler copied ("" = none)
        self.binary = binary  # BinaryName of the vgpu handler ("" = runc on PATH)
        self.notes = notes


def choose_handler(facts: nodetype.NodeFacts, nvidia_runtime: str | None, without: bool) -> Choice:
    """The table the vgpu handler starts from (a deep copy; ours is added by `vgpu_table`)."""
    notes: list[str] = []
    nv = facts.handler(facts.nvidia_handler) if facts.nvidia_handler else None
    runc = facts.handler("runc")
    if nvidia_runtime:
        base = nv or runc
        table = json.loads(json.dumps(base.table)) if base else {}
        table.setdefault("runtime_type", "io.containerd.runc.v2")
        table.setdefault("options", {})["BinaryName"] = nvidia_runtime
        return Choice(table, base.name if base else "", nvidia_runtime, ["--nvidia-runtime given"])
    if nv is not None:
        table = json.loads(json.dumps(nv.table))
        table.setdefault("runtime_type", "io.containerd.runc.v2")
        binary = nv.binary_name
        tk = facts.toolkit
        if nodetype.runtime_mode(binary, tk) == "cdi":
            binary, note = _cdi_mode_binary(facts, binary)
            table.setdefault("options", {})["BinaryName"] = binary
            notes.append(note)
        return Choice(table, nv.name, binary, notes)
    if not without:
        raise InstallError(NO_NVIDIA.format(where=", ".join(facts.files) or facts.containerd_config))
    opts = runc.table.get("options") if runc is not None else None
    table = {"runtime_type": "io.containerd.runc.v2", "options": json.loads(json.dumps(opts or {}))}
    return Choice(table, "runc" if runc else "", "", ["--without-nvidia-runtime: containers get no GPU from us"])


def uuid_named_kinds(facts: nodetype.NodeFacts) -> set[str]:
    """Kinds of the node's CDI specs that name GPUs by UUID (`nvidia-ctk cdi generate` names each
    GPU by index and by UUID; the installer's management spec has only `all`)."""
    return {c.kind for c in facts.cdi_specs if any(d.startswith(("GPU-", "MIG-")) for d in c.devices)}


def _cdi_mode_binary(facts: nodetype.NodeFacts, binary: str) -> tuple[str, str]:
    """The BinaryName for a handler whose NVIDIA runtime runs in cdi mode, and why.

    In cdi mode the device plugin's NVIDIA_VISIBLE_DEVICES=<uuid> becomes `<default-kind>=<uuid>`
    (modifier/cdi.go@v1.20.0: cdiDeviceRequestor), which resolves only where a CDI spec of that
    kind names the GPUs by UUID.  The `.legacy` sibling is the same runtime with the mode forced
    to legacy, but its prestart hook reads the same config and refuses a container unless the
    mode resolves to legacy or `skip-mode-detection = true` (hook_config.go: assertModeIsLegacy),
    which only the GPU Operator's installer sets - a host toolkit's `nvidia-ctk config default`
    leaves it false.  So `.legacy` only where its hook accepts; else the runtime stays in cdi
    mode and the GPUs must be named so the CDI path finds them (our hook stays: the runtime
    removes only NVIDIA's own prestart hooks, modifier/hook_remover.go)."""
    tk = facts.toolkit
    kind = tk.default_kind if tk is not None else "nvidia.com/gpu"
    if facts.legacy_binary and tk is not None and tk.legacy_hook_accepts():
        return facts.legacy_binary, (
            f"NVIDIA runtime in cdi mode: using its legacy-mode sibling {facts.legacy_binary} "
            f"(its hook accepts: skip-mode-detection = true in {tk.path})"
        )
    why = (
        f"{facts.legacy_binary} is not used: its hook refuses in cdi mode (skip-mode-detection = false in "
        f"{tk.path if tk else 'the toolkit config'}); "
        if facts.legacy_binary
        else "no .legacy runtime; "
    )
    if kind in uuid_named_kinds(facts):
        how = (
            f"the device plugin's envvar strategy works (NVIDIA_VISIBLE_DEVICES=<uuid> becomes {kind}=<uuid>, "
            f"which a CDI spec defines), as do cdi-annotations and cdi-cri with kind {kind}"
        )
    else:
        how = (
            f"no CDI spec of kind {kind} names GPUs by UUID, so NVIDIA_VISIBLE_DEVICES=<uuid> cannot resolve: "
            f"generate one (nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml) or run the device plugin "
            f'with device_list_strategy = ["cdi-annotations"] (or cdi-cri) and cdi_kind naming a kind whose '
            f"spec has the GPUs by UUID"
        )
    return binary, f"NVIDIA runtime in cdi mode, kept ({why}{how})"


def vgpu_table(choice: Choice, base_spec: str, facts: nodetype.NodeFacts) -> dict[str, Any]:
    """The copied table plus our base_runtime_spec and container_annotations."""
    table = json.loads(json.dumps(choice.table))
    table["base_runtime_spec"] = base_spec
    # CRI passes container annotations into the OCI spec only for the keys a runtime lists:
    # our token, and the CDI annotation prefixes the NVIDIA runtime reads in cdi mode.
    ann = [a for a in table.get("container_annotations") or [] if isinstance(a, str)]
    wanted = [ANNOTATION_GLOB]
    if choice.binary and facts.toolkit is not None:
        wanted += [p + "*" for p in facts.toolkit.annotation_prefixes]
    for a in wanted:
        if a not in ann:
            ann.append(a)
    table["container_annotations"] = ann
    return table


def _to_toml(table: dict[str, Any], comment: str | None = None) -> Any:
    t = tomlkit.table()
    if comment:
        t.add(tomlkit.comment(comment))
    for k, v in table.items():  # plain keys first, sub-tables after (tomlkit orders the output)
        t[k] = _to_toml(v) if isinstance(v, dict) else v
    return t


# ---- config editing -----------------------------------------------------------


def _table(parent: Any, key: str) -> Any:
    if key not in parent:
        parent[key] = tomlkit.table()
    return parent[key]


def _runtimes_v2(doc: Any) -> Any:
    cri = _table(_table(doc, "plugins"), V2_CRI)
    return _table(cri, "containerd")


def implicit_handlers(facts: nodetype.NodeFacts, handler: str) -> dict[str, dict[str, Any]]:
    """The handlers a 1.x config file gets from containerd's built-in defaults only.

    containerd 1.x decodes `runtimes` as a whole map: a file that defines any runtime replaces
    the built-in map, i.e. the implicit `runc` (Debian's shipped config.toml has no runtimes
    section).  Adding ours alone would leave the default runtime undefined and the CRI plugin
    would refuse to load ("no corresponding runtime configured in containerd.runtimes for
    default_runtime_name"), so such a file gets explicit copies of what the effective config had
    (from `config dump`), or containerd's default runc table where no dump was possible.
    """
    out = {h.name: json.loads(json.dumps(h.table)) for h in facts.handlers if h.name != handler and h.table}
    if not out:
        out["runc"] = {"runtime_type": "io.containerd.runc.v2"}
    return out


def edit_v2(
    text: str,
    handler: str,
    table: dict[str, Any],
    make_default: bool,
    implicit: dict[str, dict[str, Any]] | None = None,
) -> str:
    """containerd 1.x config (version 2): set runtimes.<handler>, optionally the default.

    `implicit`: handlers to write explicitly when the file has no runtimes table yet
    (`implicit_handlers`)."""
    doc = tomlkit.parse(text)
    if doc.get("version", 1) not in (2,):
        raise InstallError(f"containerd 1.x config version {doc.get('version', 1)} unsupported (need version = 2)")
    ctd = _runtimes_v2(doc)
    had_runtimes = "runtimes" in ctd
    runtimes = _table(ctd, "runtimes")
    if not had_runtimes:
        for name, t in (implicit or {}).items():
            runtimes[name] = _to_toml(t, f"added by {MARK}: containerd's built-in handler, kept explicit")
    runtimes[handler] = _to_toml(table, f"added by {MARK}: OCI hooks for vGPU containers")
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


def dropin_v3(handler: str, table: dict[str, Any], make_default: bool) -> str:
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"written by {MARK}; removed by `vgpu-hook containerd uninstall`"))
    doc["version"] = 3
    rt_parent = tomlkit.table(is_super_table=True)
    ctd = tomlkit.table(is_super_table=not make_default)
    if make_default:
        ctd["default_runtime_name"] = handler
    rts = tomlkit.table(is_super_table=True)
    rts[handler] = _to_toml(table)
    ctd["runtimes"] = rts
    rt_parent["containerd"] = ctd
    plugins = tomlkit.table(is_super_table=True)
    plugins[V3_RUNTIME] = rt_parent
    doc["plugins"] = plugins
    return tomlkit.dumps(doc)


def ensure_import(text: str, pattern: str) -> str:
    doc = tomlkit.parse(text)
    if doc.get("version", 1) not in (3, 4):
        raise InstallError("containerd 2.x needs config `version = 3` or 4 (run `containerd config migrate`)")
    imports = doc.get("imports")
    if imports is None:
        arr = tomlkit.array()
        arr.append(pattern)
        doc["imports"] = arr  # tomlkit places a plain key before the first table
    elif pattern not in list(imports):
        imports.append(pattern)
    return tomlkit.dumps(doc)


def _target_v2(facts: nodetype.NodeFacts) -> str:
    """The file install edits on containerd 1.x: the one whose CRI section containerd uses.

    On 1.x `imports` replace plugin sections per key: a drop-in that names the CRI plugin
    (the toolkit >= 1.18 writes conf.d/99-nvidia.toml with a copy of the whole CRI section)
    replaces the main file's CRI section entirely, so a handler added to the main file is
    silently lost.  We add ours inside that same drop-in's CRI section, next to the
    `nvidia` handler it copies, rather than in a later-sorting drop-in of our own carrying
    a second full copy: that copy would freeze the CRI section as it is today and shadow
    every later change to 99-nvidia.toml (a toolkit upgrade or `nvidia-ctk runtime
    configure` re-run), without any error.  The cost of our choice: re-running
    `nvidia-ctk runtime configure` regenerates the drop-in and drops `vgpu` - containerd then
    reports the missing handler at pod start, `vgpuctl doctor` FAILs, and re-running
    `vgpu-hook containerd install` puts it back.  The same rule holds on 1.6 and 1.7
    (`mergeConfig` in services/server/config/config.go); the test proves it with 1.6's
    `containerd config dump`.
    """
    return facts.cri_file or facts.containerd_config


# ---- install / uninstall ------------------------------------------------------


def _major(explicit: str | None) -> int | None:
    if not explicit:
        return None
    if explicit not in ("1", "2"):
        raise InstallError(f"--containerd-version must be 1 or 2, not {explicit!r}")
    return int(explicit)


def _read(root: Root, path: str) -> str | None:
    try:
        return root.read(path)
    except nodetype.DetectError as e:
        raise InstallError(str(e)) from None


def _write(root: Root, path: str, text: str, mode: int | None = None) -> None:
    """Atomic write under the root; an existing file keeps its mode unless one is given."""
    real = root.fs(path)
    os.makedirs(os.path.dirname(real) or ".", exist_ok=True)
    if mode is None:
        try:
            mode = os.stat(real).st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    tmp = f"{real}.{MARK}.tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, real)


def _unlink(root: Root, path: str) -> None:
    try:
        os.unlink(root.fs(path))
    except FileNotFoundError:
        pass


def _sha(text: str | None) -> str:
    return hashlib.sha256((text or "").encode("utf-8", "surrogateescape")).hexdigest()


def _default_config_text(root: Root, facts: nodetype.NodeFacts) -> str:
    if facts.containerd_bin:
        r = root.run(facts.containerd_bin, "config", "default")
        if r is not None and r.returncode == 0 and r.stdout.strip():
            return r.stdout
    return "version = 2\n"


class Plan:
    """What install would write: {host path: new text}, the node facts and what it decided."""

    def __init__(self, root: Root, facts: nodetype.NodeFacts) -> None:
        self.root = root
        self.facts = facts
        self.files: dict[str, str] = {}
        self.old: dict[str, str | None] = {}
        self.notes: list[str] = []
        self.choice: Choice | None = None


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
    prefix = cfg.device_plugin.cdi_annotation_prefix
    if prefix != CDI_DEFAULT_PREFIX:
        # The hook checks CDI annotations under this prefix too (the device plugin's, which the
        # node's NVIDIA runtime is then configured to honour), without parsing the TOML file.
        out += ["--cdi-annotation-prefix", prefix]
    return out


def detect_args(args: argparse.Namespace) -> nodetype.NodeFacts:
    try:
        return nodetype.detect(
            os.path.abspath(args.containerd_config),
            root=args.root,
            containerd_bin=args.containerd_bin,
            toolkit_config=args.toolkit_config,
            major=_major(getattr(args, "containerd_version", None)),
            exclude=getattr(args, "handler", "vgpu"),
        )
    except nodetype.DetectError as e:
        raise InstallError(str(e)) from None


def plan_install(args: argparse.Namespace, cfg: Any) -> tuple[Plan, dict[str, Any]]:
    root = Root(args.root)
    conf = os.path.abspath(args.containerd_config)
    facts = detect_args(args)
    major = facts.containerd_major
    base_spec = os.path.abspath(args.base_spec or os.path.join(os.path.dirname(conf), "vgpu-base-spec.json"))
    python = os.path.abspath(args.python or sys.executable)
    if not root.is_host:
        # Paths written into the spec are the host's: ours (inside an installer container) may not exist there.
        for what, path in (("--python", python), ("--hook-path", args.hook_path or default_hook_path())):
            if not root.exists(path):
                raise InstallError(f"{path} does not exist under --root {root.root}: pass {what} with the host's path")
    # The state dir is fixed at install time (the sh filter needs it without
    # parsing TOML): re-run install after changing common.state_dir.
    state_dir = os.path.abspath(cfg.common.state_dir)
    gargs = resolved_args(args, cfg)
    entries = hook_entries(
        python, gargs, args.hook_timeout, None if args.no_shell_filter else state_dir, args.hook_path
    )
    if facts.cri_error and not args.default:
        # Nothing we add makes the CRI plugin load (only --default, naming our handler, would):
        # saying "configured" would leave a node whose kubelet cannot start any pod.
        raise InstallError(
            f"containerd's CRI plugin will not load with this configuration: {facts.cri_error}. "
            f"{nodetype.cri_fix(facts)}; then re-run this command"
        )
    choice = choose_handler(facts, args.nvidia_runtime, args.without_nvidia_runtime)
    source = args.base_spec_source
    start_spec: dict[str, Any] | None = None
    theirs = str(choice.table.get("base_runtime_spec") or "")
    if not source and theirs and theirs != base_spec:
        # The copied handler has a base spec of its own: ours starts from it (its hooks kept).
        text = _read(root, theirs)
        if text is not None:
            try:
                start_spec = json.loads(text)
            except ValueError:
                raise InstallError(f"base_runtime_spec {theirs} of handler `{choice.source}` is not JSON") from None
    if isinstance(start_spec, dict):
        base = start_spec  # the copied handler's own base spec: its defaults are the admin's choice
    else:
        base = without_default_security(default_spec(source, root))
    spec = with_hooks(base, entries)
    table = vgpu_table(choice, base_spec, facts)
    plan = Plan(root, facts)
    plan.choice = choice
    plan.notes = list(choice.notes)
    plan.files[base_spec] = json.dumps(spec, indent=2) + "\n"
    state: dict[str, Any] = {
        "major": major,
        "handler": args.handler,
        "base_spec": base_spec,
        "config": conf,
        "node_type": facts.node_type,
        "copied_from": choice.source,
        "binary": choice.binary,
        "without_nvidia_runtime": bool(args.without_nvidia_runtime),
        "nvidia_runtime": args.nvidia_runtime or "",
    }
    prev = _load_sidecar(root, _sidecar(conf))
    prev_files = _files_of(prev)
    edited: list[str] = []
    if major == 1:
        target = _target_v2(facts)
        text = _read(root, target)
        start = text if text is not None else _default_config_text(root, facts)
        rec = prev_files.get(target)
        if rec and text is not None and _sha(text) == rec.get("installed_sha256"):
            # Unchanged since our last install: start again from what was there before it, so
            # a re-install is byte-identical (tomlkit lays out an edited table differently).
            orig = rec.get("original")
            start = orig if isinstance(orig, str) else _default_config_text(root, facts)
        try:
            ctd = tomlkit.parse(start).get("plugins", {}).get(V2_CRI, {}).get("containerd", {})
        except Exception as e:
            raise InstallError(f"cannot parse {target}: {e}") from None
        prev_default = prev.get("previous_default") if prev else ctd.get("default_runtime_name")
        if prev_default == args.handler:
            prev_default = "runc"
        plan.files[target] = edit_v2(start, args.handler, table, args.default, implicit_handlers(facts, args.handler))
        state["previous_default"] = prev_default
        state["target"] = target
        edited.append(target)
        if target != conf:
            plan.notes.append(
                f"containerd 1.x: {target} owns the CRI section (it replaces the main file's): the handler goes there"
            )
    else:
        confd = os.path.abspath(args.conf_d or os.path.join(os.path.dirname(conf), "conf.d"))
        dropin = os.path.join(confd, "vgpu.toml")
        plan.files[dropin] = dropin_v3(args.handler, table, args.default)
        state["dropin"] = dropin
        text = _read(root, conf)
        start = text if text is not None else "version = 3\n"
        plan.files[conf] = ensure_import(start, os.path.join(confd, "*.toml"))
        edited.append(conf)
    for path in plan.files:
        plan.old[path] = _read(root, path)
    files = {}
    for path in set(prev_files) | set(edited):
        rec = dict(prev_files.get(path) or {"original": plan.old.get(path) if path in plan.old else _read(root, path)})
        if path in plan.files:
            rec["installed_sha256"] = _sha(plan.files[path])
        files[path] = rec
    state["files"] = files
    return plan, state


def _sidecar(conf: str) -> str:
    return conf + f".{MARK}.json"


def _load_sidecar(root: Root, path: str) -> dict[str, Any] | None:
    t = _read(root, path)
    if t is None:
        return None
    try:
        d = json.loads(t)
    except ValueError:
        raise InstallError(f"{path} is corrupt; remove it to start over") from None
    return d if isinstance(d, dict) else None


def _files_of(state: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """{config file: {"original", "installed_sha256"}} of a sidecar (also the older one-file form)."""
    if not state:
        return {}
    files = state.get("files")
    if isinstance(files, dict):
        return {k: v for k, v in files.items() if isinstance(v, dict)}
    if "config" in state:
        return {state["config"]: {"original": state.get("original"), "installed_sha256": state.get("installed_sha256")}}
    return {}


def install(args: argparse.Namespace, cfg: Any) -> int:
    plan, state = plan_install(args, cfg)
    root = plan.root
    conf = state["config"]
    for path, rec in state["files"].items():
        bak = path + f".{MARK}.bak"
        if rec.get("original") is not None and _read(root, bak) is None:
            _write(root, bak, rec["original"], 0o600)
    _write(root, _sidecar(conf), json.dumps(state, indent=2) + "\n", 0o600)
    for path, text in plan.files.items():
        if plan.old.get(path) != text:
            _write(root, path, text)
    for n in plan.notes:
        sys.stdout.write(f"vgpu-hook: {n}\n")
    via = f" -> {state['binary']}" if state["binary"] else " -> runc (no NVIDIA runtime)"
    sys.stdout.write(
        f"vgpu-hook: containerd {state['major']}.x configured (handler `{args.handler}`{via}, "
        f"node type {state['node_type']}); restart containerd\n"
    )
    return 0


def uninstall(args: argparse.Namespace) -> int:
    root = Root(args.root)
    conf = os.path.abspath(args.containerd_config)
    side = _sidecar(conf)
    st = _load_sidecar(root, side)
    if st is None:
        sys.stdout.write("vgpu-hook: nothing to uninstall\n")
        return 0
    for path, rec in _files_of(st).items():
        current = _read(root, path)
        original = rec.get("original")
        if _sha(current) == rec.get("installed_sha256") or current == original:
            if original is None:
                _unlink(root, path)
            else:
                _write(root, path, original)
        elif current is not None and st.get("major") == 1:
            _write(root, path, remove_v2(current, st.get("handler", "vgpu"), st.get("previous_default")))
        # (2.x: an edited main config keeps its harmless `imports` entry.)
        _unlink(root, path + f".{MARK}.bak")
    for ours in (st.get("dropin"), st.get("base_spec")):
        if isinstance(ours, str) and ours:
            _unlink(root, ours)
    _unlink(root, side)
    sys.stdout.write("vgpu-hook: containerd configuration restored; restart containerd\n")
    return 0


def show(args: argparse.Namespace, cfg: Any) -> int:
    plan, _ = plan_install(args, cfg)
    out = sys.stdout
    for line in nodetype.summary(plan.facts):
        out.write(f"# {line}\n")
    c = plan.choice
    if c is not None:
        src = f"a copy of handler `{c.source}`" if c.source else "a new table"
        out.write(f"# handler `{args.handler}`: {src}, BinaryName {c.binary or '(runc on PATH)'}\n")
    for n in plan.notes:
        out.write(f"# {n}\n")
    for path in sorted(plan.files, key=lambda p: p.endswith(".json")):  # the configs first, the base spec last
        text = plan.files[path]
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


def detect(args: argparse.Namespace) -> int:
    facts = detect_args(args)
    if getattr(args, "json", False):
        sys.stdout.write(nodetype.to_json(facts))
    else:
        sys.stdout.write("\n".join(nodetype.summary(facts)) + "\n")
    return 0


def command(args: argparse.Namespace, cfg: Any) -> int:
    if args.action == "install":
        return install(args, cfg)
    if args.action == "uninstall":
        return uninstall(args)
    if args.action == "detect":
        return detect(args)
    return show(args, cfg)
