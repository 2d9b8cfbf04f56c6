"""A server the plugin starts, waits for and stops: a command line plus environment, its output
kept in a log file beside the report.

Its CPU time is the measured work, not another job's contention: while it runs, the host meter
counts its process group as this process's own (pytest_moeperf.host_load.MEASURED_GROUPS).

It starts in a session of its own, so stopping it (SIGTERM, then SIGKILL after a grace period)
reaches its whole process group (vLLM forks engine processes) and only that group: what is stopped
is found by the process id this object started, never by name or port. Every started server is
also stopped at interpreter exit, so a run ended by Ctrl-C or SIGTERM leaves none behind.

`wait_healthy` polls `/health` (then `/v1/models` for servers without it) until the server
answers 200 or the start-up timeout passes; a server that exits first, or never answers, is an
error that quotes the last lines of its log.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from pytest_moeperf import host_load

__all__ = ["ManagedServer", "ServerStartError", "free_port"]

LOG_TAIL_LINES = 20


class ServerStartError(RuntimeError):
    """A managed server exited or never became healthy; the message quotes its log's last lines."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's choice)."""
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_running: "set[ManagedServer]" = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()


class ManagedServer:
    def __init__(self, name: str, command: list[str], env: dict[str, str], base_url: str, log_path: Path,
                 startup_timeout_s: float = 300.0, stop_grace_s: float = 20.0, nice: int = 0) -> None:
        self.name, self.command, self.env, self.base_url = name, list(command), dict(env), base_url.rstrip("/")
        self.log_path, self.startup_timeout_s, self.stop_grace_s = Path(log_path), startup_timeout_s, stop_grace_s
        self.nice = nice
        self.process: subprocess.Popen | None = None
        self.started_s: float | None = None  # seconds from the start until healthy

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"# {self.name}: {' '.join(self.command)}\n".encode())
        log.flush()
        try:
            nice = self.nice
            self.process = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
        except OSError as e:
            raise ServerStartError(f"server {self.name!r} could not start: {' '.join(self.command)}: {e}") from None
        finally:
            log.close()
        _running.add(self)
        host_load.MEASURED_GROUPS.add(self.process.pid)  # its own session: its pid is its group

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def exited_within(self, seconds: float) -> bool:
        """Whether the server has exited, waiting up to `seconds`: a killed process closes its sockets
        before it can be reaped, so a reset connection can arrive while it still reads as running."""
        if self.process is None:
            return True
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def wait_healthy(self, client: httpx.Client) -> None:
        start = time.monotonic()
        paths = ("/health", "/v1/models")
        while True:
            if not self.alive():
                code = None if self.process is None else self.process.returncode
                raise ServerStartError(f"server {self.name!r} exited (status {code}) before it became healthy; the "
                                       f"last lines of {self.log_path}:\n{self.log_tail()}")
            for path in paths:
                try:
                    if client.get(self.base_url + path, timeout=5.0).status_code == 200:
                        self.started_s = time.monotonic() - start
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() - start > self.startup_timeout_s:
                self.stop()
                raise ServerStartError(f"server {self.name!r} did not become healthy at {self.base_url} (/health, "
                                       f"/v1/models) within {self.startup_timeout_s:g} s; the last lines of "
                                       f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after the grace period; idempotent."""
        process, self.process = self.process, None
        _running.discard(self)
        if process is not None:
            host_load.MEASURED_GROUPS.discard(process.pid)
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # what of its group outlived it (an engine process its parent did not reap)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
