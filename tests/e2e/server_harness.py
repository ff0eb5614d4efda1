"""A `tokenmill serve` subprocess on a free loopback port, for the server tests (startup takes ~20 s on a small
CPU machine: modules that need no flags of their own share one, the `shared_server` fixture of conftest.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240
SHARED_SERVER_MODEL = "smollm2"
"""The shared server's --served-model-name."""
SHARED_SERVER_API_KEY = "shared-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All live processes under `pid` (from /proc, so no psutil is needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields resume after the last ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class RemoteServer:
    def __init__(self, model: str, *args: str, api_key: str | None = None, uds: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        """uds: serve on this Unix socket path (--uds) rather than a TCP port; reach it with http(). env: variables
        set for the server on top of this process's."""
        self.api_key, self.uds = api_key, uds
        if uds is None:
            self.port = free_port()
            self.base_url = f"http://{HOST}:{self.port}"
            listen = ["--host", HOST, "--port", str(self.port)]
        else:
            self.port, self.base_url, listen = None, "http://tokenmill", ["--uds", uds]
        command = [sys.executable, "-m", "tokenmill.cli", "serve", model, *listen, "--uvicorn-log-level", "warning",
                   *args]
        if api_key is not None:
            command += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-server-", suffix=".log", delete=False)
        env = {**{k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}, **(env or {})}
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        # One client: a new one builds an SSL context per call (~20 ms of CPU, taken from the starting server), a
        # refused connection on a kept client ~0.1 ms; so a fine poll, which notices the server ~0.2 s sooner.
        with self.http(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with {self.proc.returncode} during startup:\n{self.log_tail()}")
                try:
                    if http.get("/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"the server was not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def http(self, **kwargs) -> httpx.Client:
        """A client of this server (over its Unix socket with uds), with its API key; paths relative to it."""
        transport = None if self.uds is None else httpx.HTTPTransport(uds=self.uds)
        return httpx.Client(transport=transport, base_url=self.base_url, headers=self.headers, **kwargs)

    def openai_client(self):
        """The openai SDK pointed at this server: no retries (a failure shows at once), a generous timeout."""
        import openai

        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "EMPTY", max_retries=0, timeout=120)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_core_pid(self) -> int:
        [pid] = [p for p in descendants(self.proc.pid) if "spawn_main" in cmdline(p)]
        return pid

    def log_tail(self, num_chars: int = 4000) -> str:
        with open(self.log.name) as f:
            return f.read()[-num_chars:]

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM, then SIGKILL (the server and what it left) if it does not exit in time."""
        if self.proc.poll() is None:
            left = descendants(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *left]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
