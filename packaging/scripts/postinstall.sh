#!/bin/sh
# k8s-vgpu post-install.  deb: postinst configure [<old-version>]; rpm: %post <installed-count>.
#
# - creates the state directory (root-only) and the hook's log directory;
# - enables (fresh install) and starts, or restarts (upgrade), the two units;
# - does NOT touch containerd unless the admin asked for it with VGPU_CONFIGURE_CONTAINERD=1
#   in the environment of dpkg/apt/rpm: restarting containerd on a busy node is the admin's call.
set -e

case "$1" in
  configure) if [ -n "${2:-}" ]; then upgrade=1; else upgrade=0; fi ;;
  [0-9]*) if [ "$1" -gt 1 ]; then upgrade=1; else upgrade=0; fi ;;
  *) exit 0 ;;
esac

# Allocation records and per-container state: root-only (they name every vGPU container).
install -d -m 0700 -o root -g root /var/lib/vgpu
chmod 0700 /var/lib/vgpu
install -d -m 0750 -o root -g root /var/log/vgpu

units="vgpu-device-plugin.service vgpu-monitor.service"
booted=0
[ -d /run/systemd/system ] && booted=1

if command -v systemctl >/dev/null 2>&1; then
  [ "$booted" = 1 ] && systemctl daemon-reload >/dev/null 2>&1 || true
  if [ "$upgrade" = 0 ]; then
    # shellcheck disable=SC2086
    systemctl enable $units >/dev/null 2>&1 || echo "k8s-vgpu: could not enable $units" >&2
  fi
fi

containerd_changed=0
sidecar=/etc/containerd/config.toml.vgpu-hook.json
if [ "${VGPU_CONFIGURE_CONTAINERD:-0}" = 1 ]; then
  # VGPU_WITHOUT_NVIDIA_RUNTIME=1: a node whose GPU reaches containers without NVIDIA's runtime (simulator).
  nvflag=
  [ "${VGPU_WITHOUT_NVIDIA_RUNTIME:-0}" = 1 ] && nvflag=--without-nvidia-runtime
  # shellcheck disable=SC2086
  if vgpu-hook containerd install $nvflag; then
    containerd_changed=1
  else
    echo "k8s-vgpu: 'vgpu-hook containerd install' failed; containerd is unchanged" >&2
  fi
elif [ "$upgrade" = 1 ] && [ -e "$sidecar" ]; then
  # The hook was wired before: refresh its base spec (interpreter path, flags from the current
  # /etc/vgpu/config.toml) with the handler and spec path recorded at install time.
  spec=$(/opt/vgpu/bin/python -I -c 'import json, sys; print(json.load(open(sys.argv[1])).get("base_spec", ""))' "$sidecar" 2>/dev/null || true)
  before=$(cat "$spec" 2>/dev/null | cksum)
  if /opt/vgpu/bin/python -I - "$sidecar" <<'PY'
import json, os, sys
state = json.load(open(sys.argv[1]))
args = ["vgpu-hook", "containerd", "install", "--handler", str(state.get("handler", "vgpu"))]
if state.get("base_spec"):
    args += ["--base-spec", str(state["base_spec"])]
if state.get("nvidia_runtime"):
    args += ["--nvidia-runtime", str(state["nvidia_runtime"])]
if state.get("without_nvidia_runtime"):
    args.append("--without-nvidia-runtime")
os.execv("/usr/bin/vgpu-hook", args)
PY
  then
    if [ "$(cat "$spec" 2>/dev/null | cksum)" != "$before" ]; then
      echo "k8s-vgpu: the hook's runtime spec changed; apply it with: systemctl restart containerd"
    fi
  else
    echo "k8s-vgpu: refreshing the containerd wiring failed; run: vgpu-hook containerd install" >&2
  fi
fi

if [ "$booted" = 1 ] && command -v systemctl >/dev/null 2>&1; then
  if [ "$containerd_changed" = 1 ]; then
    systemctl restart containerd.service || echo "k8s-vgpu: restarting containerd failed" >&2
  fi
  if [ "$upgrade" = 1 ]; then
    # shellcheck disable=SC2086
    systemctl try-restart $units || true
  else
    # shellcheck disable=SC2086
    systemctl start $units || echo "k8s-vgpu: could not start $units (see journalctl -u vgpu-monitor)" >&2
  fi
fi

if [ "$upgrade" = 0 ] && [ "$containerd_changed" = 0 ]; then
  cat <<'MSG'
k8s-vgpu installed.  To run vGPU containers, wire the hook into containerd once:
    vgpu-hook containerd install && systemctl restart containerd
then apply the RuntimeClass: kubectl apply -f /usr/share/vgpu/k8s/runtimeclass.yaml
(with VGPU_CONFIGURE_CONTAINERD=1 in the environment, the package does the first step itself).
MSG
fi
exit 0
