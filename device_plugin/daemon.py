"""The plugin's life cycle: serve, register, follow kubelet restarts, stop cleanly.

Threads: the main thread runs `Daemon.run()` (the supervisor: serving,
registration, restarts, signals); the health monitor waits on XID events;
a housekeeping thread garbage-collects records and refreshes the Node
inventory annotation; gRPC has its own worker pool.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from device_plugin import checkpoint, decision, dynmig, inventory, strategy, usage
from device_plugin.mig import Resource
from device_plugin.registration import RegistrationError, register
from device_plugin.server import PluginServer
from device_plugin.watcher import SocketWatcher
from nodecore import records
from nodecore.core import NodeCore
from nodecore.devices import Slicing
from vgpu.config import DevicePluginConfig
from vgpu.log import kv
from vgpu.nvml import GPUInfo
from vgpu.paths import Paths

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
# Supervisor cadence: how long one wait for a kubelet.sock event lasts (signals
# end it early through `wake()`), how often the server's liveness is probed,
# and how often a failed registration is retried.
_TICK_S = 1.0
_LIVENESS_S = 5.0
_REGISTER_RETRY_S = 2.0


def notify_ready() -> None:
    """sd_notify("READY=1") when systemd started us as a Type=notify unit (NOTIFY_SOCKET set).

    The package's unit is `Type=notify` and `Before=kubelet.service`: at boot the kubelet is
    started only once the plugin serves, so the plugin registers within milliseconds of the
    kubelet's registration socket, before the kubelet re-admits the node's pods (a pod whose
    containers need a healthy vGPU then is rejected while no plugin has listed its devices).
    """
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr.startswith(("/", "@")):
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(b"READY=1")
    except OSError as e:
        log.warning(kv("cannot notify systemd", socket=addr, error=e))


@dataclass(frozen=True)
class PluginPaths:
    kubelet_dir: str
    socket_name: str

    @property
    def device_plugins_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "device-plugins")

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.device_plugins_dir, KUBELET_SOCKET)

    @property
    def plugin_socket(self) -> str:
        return os.path.join(self.device_plugins_dir, self.socket_name)

    @property
    def checkpoint(self) -> str:
        return checkpoint.default_path(self.kubelet_dir)


class ExtraResource:
    """A further resource of the node's MIG strategy (device_plugin/mig.py, `mixed`:
    `nvidia.com/mig-<profile>`): its devices whole, its own socket, server, registration, health
    and allocation records; no inventory, usage or scheduler decisions (kube-scheduler counts it)."""

    def __init__(self, res: Resource, cfg: DevicePluginConfig, state: Paths, nvml_health: bool) -> None:
        self.res = res
        self.where = PluginPaths(cfg.kubelet_dir, res.socket_name)
        self.core = NodeCore(res.devices, res.slicing, state, health_recovery_s=cfg.health_recovery_s,
                             nvml_health=nvml_health, plain_ids=res.plain_ids)  # fmt: skip
        self.collector = records.RecordCollector(state, res.name, cfg.record_gc_grace_s)
        self.server: PluginServer | None = None
        self.registered = False
        self.failed = False  # serving failed: said once, retried quietly


class Daemon:
    def __init__(
        self,
        cfg: DevicePluginConfig,
        state: Paths,
        gpus: Sequence[GPUInfo],
        *,
        nvml_health: bool = True,
        resources: Sequence[Resource] = (),
    ):
        self.cfg = cfg
        self.paths = state
        self.where = PluginPaths(cfg.kubelet_dir, cfg.socket_name)
        self._inventory_dirty = threading.Event()
        slicing = Slicing(cfg.device_split_count, cfg.device_memory_scaling, cfg.device_cores_scaling)
        # The MIG strategy's resources (device_plugin/mig.py); without them, the GPUs under
        # resource_name.  The primary one is served as before; others alongside it.
        primary = next((r for r in resources if r.primary), None)
        self.register_empty, plain_ids = True, False
        if primary is not None:
            gpus, slicing = list(primary.devices), primary.slicing
            self.register_empty, plain_ids = primary.register_empty, primary.plain_ids
        self.extras = [ExtraResource(r, cfg, state, nvml_health) for r in resources if not r.primary and r.devices]
        # mig_strategy dynamic: the GPUs in MIG mode make an instance per scheduled container
        self.dynmig = (
            dynmig.DynamicMig(state, [g for g in gpus if g.uuid in primary.dynamic])
            if primary is not None and primary.dynamic
            else None
        )
        self.core = NodeCore(
            gpus,
            slicing,
            state,
            health_recovery_s=cfg.health_recovery_s,
            nvml_health=nvml_health,
            on_health_change=self._inventory_dirty.set,
            plain_ids=plain_ids,
        )
        self.table = self.core.table
        self.health = self.core.health
        self.stop_event = threading.Event()
        self.restart_event = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        node = inventory.node_name(cfg.node_name)
        # What the node handed out, published with the inventory (docs/developers/scheduler.md, "Usage"),
        # each slice named by the pod holding it from the kubelet's checkpoint.
        self.usage = usage.Tracker(state, cfg.resource_name, self.where.checkpoint)
        if self.dynmig is not None:
            self.usage.placed = self.dynmig.placed
        self.annotator = inventory.NodeAnnotator(
            self.table,
            cfg.resource_name,
            node,
            cfg.inventory_heartbeat_s,
            usage=self.usage.doc,
            # Tags of records written before a restart, from the pods' `allocated` lists (only
            # the decisions path writes those: with decisions off there is nothing to ask).
            on_client=(lambda api: usage.rebuild_from_api(self.usage, api, node)) if cfg.decisions != "off" else None,
            mig=self.dynmig.inventory if self.dynmig is not None else None,
        )
        self.reaper = dynmig.Reaper(self.dynmig, node) if self.dynmig is not None else None
        self.decisions = (
            decision.Decisions(self.table, node, cfg.decisions, cfg.allocation_policy)
            if cfg.decisions != "off"
            else None
        )
        self.collector = records.RecordCollector(state, cfg.resource_name, cfg.record_gc_grace_s)
        self.server: PluginServer | None = None
        self.registered = False
        self.restarts = 0
        self._checkpoint_warned = False
        self._register_failed = False

    # --- supervisor -----------------------------------------------------------
    def wake(self) -> None:
        """End the supervisor's current wait (async-signal-safe: one write to a pipe)."""
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass

    def stop(self) -> None:
        self.stop_event.set()
        self.wake()

    def request_restart(self) -> None:
        self.restart_event.set()
        self.wake()

    def _service_args(self) -> dict:
        return {
            "table": self.table,
            "paths": self.paths,
            "resource_name": self.cfg.resource_name,
            "policy": self.cfg.allocation_policy,
            "decisions": self.decisions,
            "on_allocated": self._allocated,
            "prepare": dynmig.preparer(self.dynmig) if self.dynmig is not None else None,
            "strategy": strategy.Strategy(
                names=tuple(self.cfg.device_list_strategy),
                cdi_kind=self.cfg.cdi_kind,
                annotation_prefix=self.cfg.cdi_annotation_prefix,
            ),
        }

    def _extra_args(self, x: ExtraResource) -> dict:
        return {
            "table": x.core.table,
            "paths": self.paths,
            "resource_name": x.res.name,
            "policy": self.cfg.allocation_policy,
            "strategy": strategy.Strategy(
                names=tuple(self.cfg.device_list_strategy),
                cdi_kind=self.cfg.cdi_kind,
                annotation_prefix=self.cfg.cdi_annotation_prefix,
            ),
        }

    def _serve_extra(self, x: ExtraResource) -> None:
        x.registered = False
        if x.server is not None:
            x.server.stop()
            x.server = None
        server = PluginServer(self._extra_args(x), x.where.plugin_socket)
        try:
            server.start()
            server.wait_ready()
        except Exception as e:
            (log.debug if x.failed else log.error)(kv("cannot serve", socket=x.where.plugin_socket, error=e))
            x.failed = True
            server.stop()
            return
        x.failed = False
        x.server = server

    def _register_extra(self, x: ExtraResource) -> None:
        if x.server is None or not os.path.exists(self.where.kubelet_socket):
            return
        try:
            register(self.where.kubelet_socket, x.res.socket_name, x.res.name)
        except RegistrationError as e:
            log.debug(kv("registration failed, will retry", resource=x.res.name, error=e))
            return
        x.registered = True
        log.warning(kv("registered with kubelet", resource=x.res.name, endpoint=x.res.socket_name,
                       devices=len(x.core.table.by_id)))  # fmt: skip

    def _extras_tick(self, restart: bool, live: bool) -> None:
        """Serve, register and watch the further resources with the primary one."""
        for x in self.extras:
            if restart or x.server is None or (live and not x.server.alive()):
                self._serve_extra(x)
                self._register_extra(x)
            elif not x.registered:
                self._register_extra(x)

    def _allocated(self, token: str, pod_uid: str, container: str) -> None:
        self.usage.note(token, pod_uid, container)
        self._inventory_dirty.set()  # wakes housekeeping: the usage annotation is due

    def _serve(self) -> bool:
        """(Re)start the gRPC server; False (logged) when it cannot serve."""
        self.registered = False
        if self.server is not None:
            self.server.stop()
            self.server = None
        server = PluginServer(self._service_args(), self.where.plugin_socket)
        try:
            server.start()
            server.wait_ready()
        except Exception as e:  # bind failure, server never answering
            log.error(kv("cannot serve", socket=self.where.plugin_socket, error=e))
            server.stop()
            return False
        self.server = server
        return True

    def _register(self) -> bool:
        if not os.path.exists(self.where.kubelet_socket):
            return False
        if not self.register_empty and not self.table.by_id:
            # mixed without GPUs outside MIG mode: NVIDIA's plugin registers no resource without
            # devices (rm.NewNVMLResourceManagers), and neither do we
            return False
        try:
            register(self.where.kubelet_socket, self.cfg.socket_name, self.cfg.resource_name)
        except RegistrationError as e:
            # Retried every 2 s: warn once per outage, not on every attempt.
            (log.debug if self._register_failed else log.warning)(
                kv("registration failed, will retry", kubelet=self.where.kubelet_socket, error=e)
            )
            self._register_failed = True
            return False
        self.registered = True
        self._register_failed = False
        log.warning(
            kv(
                "registered with kubelet",
                resource=self.cfg.resource_name,
                endpoint=self.cfg.socket_name,
                gpus=len(self.table.gpus),
                vgpus=len(self.table.by_id),
                restarts=self.restarts,
            )
        )
        return True

    def restart(self, why: str) -> None:
        """Stop serving, serve afresh, register again (kubelet restart, SIGHUP, crash)."""
        self.restarts += 1
        log.warning(kv("restarting plugin server", reason=why))
        if self._serve():
            self._register()
        self._extras_tick(restart=True, live=False)

    def run(self) -> int:
        records.ensure_dir(self.paths)
        os.makedirs(self.where.device_plugins_dir, exist_ok=True)
        watcher = SocketWatcher(self.where.device_plugins_dir, KUBELET_SOCKET, self._wake_r)
        housekeeping = threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True)
        try:
            if self.health is not None:
                self.health.start()
            for x in self.extras:
                x.core.start()
            housekeeping.start()
            notified = False
            self._extras_tick(restart=True, live=False)
            if self._serve():
                self._register()
                notify_ready()
                notified = True
            last_live = last_try = time.monotonic()
            while not self.stop_event.is_set():
                kubelet_new = watcher.wait(_TICK_S)
                if self.stop_event.is_set():
                    break
                if kubelet_new:
                    self.restart("kubelet.sock created")
                    continue
                if self.restart_event.is_set():
                    self.restart_event.clear()
                    self.restart("SIGHUP")
                    continue
                now = time.monotonic()
                if not self.registered and now - last_try >= _REGISTER_RETRY_S:
                    last_try = now
                    if self.server is None:
                        self.restart("serving failed earlier")
                    else:
                        self._register()
                if not notified and self.server is not None:
                    notify_ready()
                    notified = True
                if now - last_try >= _REGISTER_RETRY_S and any(not x.registered for x in self.extras):
                    last_try = now
                    self._extras_tick(restart=False, live=False)
                if now - last_live >= _LIVENESS_S:
                    last_live = now
                    if self.server is not None and not self.server.alive():
                        self.restart("plugin socket gone or server not answering")
                    else:
                        self._extras_tick(restart=False, live=True)
        finally:
            watcher.close()
            if self.server is not None:
                self.server.stop()
                self.server = None
            for x in self.extras:
                if x.server is not None:
                    x.server.stop()
                    x.server = None
                x.core.stop()
            if self.health is not None:
                self.health.stop()
            self.table.kick()
        log.info("stopped")
        return 0

    # --- housekeeping -----------------------------------------------------------
    def gc_once(self) -> list[str]:
        try:
            replayable = checkpoint.replayable_tokens(self.where.checkpoint, self.cfg.resource_name)
        except checkpoint.CheckpointUnusable as e:
            # Without it nothing tells which records the kubelet may still replay: keep them all.
            if not self._checkpoint_warned:
                log.warning("kubelet device checkpoint unusable, keeping allocation records: %s", e)
                self._checkpoint_warned = True
            return []
        if self._checkpoint_warned:
            log.warning("kubelet device checkpoint readable again, collecting allocation records")
            self._checkpoint_warned = False
        deleted = self.collector.collect(replayable)
        for x in self.extras:
            try:
                deleted += x.collector.collect(checkpoint.replayable_tokens(self.where.checkpoint, x.res.name))
            except checkpoint.CheckpointUnusable:
                pass
        if deleted:
            self._inventory_dirty.set()  # the usage annotation is due
        for tok in deleted:
            log.info(kv("allocation record removed", token=tok[:8] + "…", reason="kubelet no longer keeps it"))
        return deleted

    def _housekeeping(self) -> None:
        next_gc = time.monotonic() + min(self.cfg.record_gc_interval_s, 5.0)
        next_inv = time.monotonic()
        self._inventory_dirty.set()
        while not self.stop_event.is_set():
            try:
                if self.usage.refresh():  # a stat; the kubelet wrote its checkpoint: new names
                    self._inventory_dirty.set()
            except Exception:
                log.exception("reading the kubelet's checkpoint for usage names failed")
            now = time.monotonic()
            if self._inventory_dirty.is_set() or now >= next_inv or self.annotator.pending:
                self._inventory_dirty.clear()
                next_inv = now + self.cfg.inventory_heartbeat_s
                self.annotator.publish()
            try:
                if self.reaper is not None and self.reaper.tick(now):
                    self._inventory_dirty.set()  # instances destroyed: the inventory is due
            except Exception:
                log.exception("destroying the MIG instances of gone pods failed")
            if now >= next_gc:
                next_gc = now + self.cfg.record_gc_interval_s
                try:
                    self.gc_once()
                except Exception:
                    log.exception("record garbage collection failed")
            wait = max(0.05, min(next_gc, next_inv) - time.monotonic())
            self._inventory_dirty.wait(min(wait, 1.0))
