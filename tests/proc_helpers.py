"""The ``sharegpu`` command as a real process: start it, read its log lines as they come, stop it."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MAIN = "import sys; from sharegpu.cli import main; sys.argv[0] = 'sharegpu'; main()"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: c\n  cluster: {{server: '{server}', insecure-skip-tls-verify: true}}\n"
        "contexts:\n- name: x\n  context: {cluster: c, user: u}\n"
        "users:\n- name: u\n  user: {token: t}\n"
        "current-context: x\n"
    )
    return path


class Proc:
    """``sharegpu ARGS`` with stdout and stderr merged into lines read by a thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", MAIN, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, cond: Callable[[str], bool], timeout: float = 30) -> str:
        """The first line (from now on) for which ``cond`` holds; AssertionError with the output when none came."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("timed out; output so far:\n" + "\n".join(self.lines)) from None
            if line is None:
                raise AssertionError(f"exited ({self.popen.wait()}); output:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if cond(line):
                return line

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM, then the exit code (SIGKILL after ``timeout``)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
