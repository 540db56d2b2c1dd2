"""The hook's log: one line per event appended to <log_dir>/hook.log, bounded in size.

Not the `logging` package: importing logging.handlers costs more than the
rest of a vGPU container's setup, and the hook writes a handful of lines per
container.  When the file exceeds max_bytes it is renamed to hook.log.1
(one generation kept), so the log never takes more than 2 x max_bytes.
Logging problems are never a reason to fail a container. Lines are vgpu.log.kv's.
"""

from __future__ import annotations

import os
import time

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class HookLog:
    def __init__(self, log_dir: str | None = None, max_bytes: int = 4 << 20, level: str = "warning") -> None:
        self.path = os.path.join(log_dir, "hook.log") if log_dir else None
        self.max_bytes = max_bytes
        self.level = LEVELS.get(level, 30)

    def _write(self, level: str, line: str) -> None:
        if self.path is None or LEVELS[level] < self.level:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data = f"{stamp} {level.upper()} vgpu-hook[{os.getpid()}]: {line}\n".encode("utf-8", "replace")
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
            try:
                if os.stat(self.path).st_size + len(data) > self.max_bytes:
                    os.replace(self.path, self.path + ".1")
            except FileNotFoundError:
                pass
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError:
            pass

    def debug(self, line: str) -> None:
        self._write("debug", line)

    def info(self, line: str) -> None:
        self._write("info", line)

    def warning(self, line: str) -> None:
        self._write("warning", line)

    def error(self, line: str) -> None:
        self._write("error", line)


log = HookLog()  # replaced by cli once the configuration is known
