"""A real Prometheus (Debian's `prometheus` package) started by a test on loopback, with its own
configuration and storage in a temporary directory, stopped by the PID it was started with; and
its HTTP API (docs: prometheus.io/docs/prometheus/latest/querying/api/)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

BINARY = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiError(RuntimeError):
    pass


class Prometheus:
    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = self.dir / "prometheus.log"

    def start(self, timeout: float = 60.0) -> Prometheus:
        for _attempt in range(3):  # the free port may be taken between our probe and its bind
            self.port = free_port()
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [
                        BINARY,
                        f"--config.file={self.config_path}",
                        f"--storage.tsdb.path={self.dir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            end = time.monotonic() + timeout
            while time.monotonic() < end and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                        if r.status == 200:
                            return self
                except (OSError, urllib.error.URLError):
                    pass
                time.sleep(0.1)
            if self.proc.poll() is None:
                break
        self.stop()
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_path.read_text()[-3000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.terminate()  # our own child, by its PID
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP API ------------------------------------------------------------
    def get(self, path: str, params: list[tuple[str, str]] | dict[str, str] | None = None) -> Any:
        q = urllib.parse.urlencode(params or {})
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ApiError(f"{path} {params}: HTTP {e.code}: {e.read()[:500]!r}") from e
        if body.get("status") != "success":
            raise ApiError(f"{path} {params}: {body}")
        if body.get("warnings"):
            raise ApiError(f"{path} {params}: warnings {body['warnings']}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query_range", {"query": expr, "start": str(start), "end": str(end), "step": str(step)})
        assert data["resultType"] == "matrix", data
        return list(data["result"])

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        data = self.get("/api/v1/query", params)
        return list(data["result"]) if data["resultType"] == "vector" else [data["result"]]

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        return list(
            self.get(f"/api/v1/label/{label}/values", [("match[]", match), ("start", str(start)), ("end", str(end))])
        )

    def series(self, match: str, start: float, end: float) -> list[dict[str, str]]:
        return list(self.get("/api/v1/series", [("match[]", match), ("start", str(start)), ("end", str(end))]))

    def targets(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/targets", {"state": "active"})["activeTargets"])

    def target_metadata(self, job: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/targets/metadata", {"match_target": f'{{job="{job}"}}'}))
