"""The DRA plugin's life cycle: recover, serve, publish, follow health, stop cleanly.

Threads: the main thread runs `DRADaemon.run()` (serving and its liveness: a socket deleted or
replaced under us is served afresh); the node core's health monitor (nodecore.health)
waits on XID events; a publisher thread keeps the ResourceSlices current (at start, on a health
change, every `resync_s`); gRPC has its own workers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from dra_plugin import apiclient
from dra_plugin.config import Settings
from dra_plugin.driver import Driver
from dra_plugin.publisher import Publisher
from dra_plugin.server import PluginServer
from nodecore.core import NodeCore
from vgpu.log import kv
from vgpu.nvml import GPUInfo

log = logging.getLogger(__name__)

_TICK_S = 1.0
_LIVENESS_S = 5.0


class DRADaemon:
    def __init__(
        self,
        cfg: Settings,
        gpus: Sequence[GPUInfo],
        api: apiclient.ResourceAPI | None,
        *,
        nvml_health: bool = True,
    ) -> None:
        self.cfg = cfg
        self.node = cfg.node()
        self.api = api
        self.stop_event = threading.Event()
        self._health_changed = threading.Event()
        # Prepare refuses an unhealthy GPU at once (it asks the core); the publisher withdraws it.
        self.core = NodeCore(
            gpus,
            cfg.slicing,
            cfg.paths,
            health_recovery_s=cfg.health_recovery_s,
            nvml_health=nvml_health,
            on_health_change=self._on_health_change,
        )
        self.driver = Driver(cfg, self.node, self.core, api)
        self.publisher = (
            Publisher(api, cfg, self.node, self.core.healthy_gpus) if (api is not None and cfg.publish) else None
        )
        self.server: PluginServer | None = None

    def _on_health_change(self) -> None:
        self._health_changed.set()  # the publisher withdraws or restores the GPU
        server = getattr(self, "server", None)  # None until the first serve
        if server is not None:
            server.health.changed()  # the kubelet's health stream

    def stop(self) -> None:
        self.stop_event.set()
        self._health_changed.set()

    def _serve(self) -> bool:
        if self.server is not None:
            self.server.stop()
        server = PluginServer(self.driver, self.cfg.registration_socket, self.cfg.endpoint)
        try:
            server.start()
        except Exception as e:  # bind failure, our own socket not answering
            log.error(kv("cannot serve", endpoint=self.cfg.endpoint, error=e))
            server.stop()
            self.server = None
            return False
        self.server = server
        log.warning(
            kv(
                "serving",
                driver=self.cfg.driver_name,
                registration=self.cfg.registration_socket,
                endpoint=self.cfg.endpoint,
                gpus=len(self.core.gpus),
            )
        )
        return True

    def _publish_loop(self) -> None:
        assert self.publisher is not None
        next_sync = 0.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            if self._health_changed.is_set() or now >= next_sync:
                self._health_changed.clear()
                ok = self.publisher.sync()
                next_sync = now + (self.cfg.resync_s if ok else min(5.0, self.cfg.resync_s))
            self._health_changed.wait(max(0.05, min(1.0, next_sync - time.monotonic())))

    def run(self) -> int:
        self.driver.recover()
        os.makedirs(self.cfg.paths.dra_dir, mode=0o700, exist_ok=True)
        if self.api is None:
            log.warning("no Kubernetes API server configured: no ResourceSlices, and claims cannot be prepared")
        threads: list[threading.Thread] = []
        try:
            self.core.start()
            if self.publisher is not None:
                t = threading.Thread(target=self._publish_loop, name="publisher", daemon=True)
                t.start()
                threads.append(t)
            self._serve()
            last_live = time.monotonic()
            while not self.stop_event.wait(_TICK_S):
                now = time.monotonic()
                if now - last_live >= _LIVENESS_S:
                    last_live = now
                    if self.server is None or not self.server.alive():
                        log.warning(kv("serving afresh", reason="socket gone or replaced"))
                        self._serve()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None
            self.core.stop()
            self.driver.close()
            for t in threads:
                t.join(timeout=3)
        log.info("stopped")
        return 0
