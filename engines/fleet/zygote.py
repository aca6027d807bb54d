"""The fleet's end of the SGLang zygote (`engines/sglang/shim/areal_like_sglang_zygote.py`):
one interpreter in the SGLang venv imports SGLang once, and every server of the fleet (and
every restart) is forked from it instead of importing SGLang again. On a small CPU machine the
import is most of a server's start (~10 s of a core each).

`ForkedServer` stands for one forked server where the fleet holds a `subprocess.Popen`:
`pid`, `poll()`, `wait()`, `returncode` (negative: killed by that signal). The zygote is the
servers' parent, so it reaps them and reports each exit; a server forked but not yet named has
no pid, and `poll()` says it runs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from engines.server.errors import ServerStartError

ZYGOTE_MODULE = "areal_like_sglang_zygote"


class ForkedServer:
    """A server forked by the zygote; the `subprocess.Popen` calls the fleet makes."""

    def __init__(self, zygote: ServerZygote, log: Path) -> None:
        self._zygote = zygote
        self.log = log
        self.pid: Optional[int] = None  # set once the zygote forked it
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and self.pid is None and not self._zygote.alive():
            self.returncode = self._zygote.returncode_for_unforked()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._zygote.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout or 0)
                self._zygote.changed.wait(0.5 if left is None else min(left, 0.5))
        assert self.returncode is not None
        return self.returncode


class ServerZygote:
    """`<python> -m areal_like_sglang_zygote`, started at once; `fork()` queues a server.

    The zygote's own output (its imports' warnings) is kept in memory, its last lines named
    in the error when it fails to start."""

    def __init__(self, python: Path, env: dict[str, str], preexec: Any) -> None:
        self.process = subprocess.Popen(
            [str(python), "-m", ZYGOTE_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, start_new_session=True, preexec_fn=preexec)
        self.changed = threading.Condition()
        self.ready = False
        self._queued: collections.deque[ForkedServer] = collections.deque()
        self._by_pid: dict[int, ForkedServer] = {}
        self._stderr: collections.deque[str] = collections.deque(maxlen=30)
        self._write_lock = threading.Lock()
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True,
                                               name="zygote-stderr")
        self._stderr_reader.start()
        threading.Thread(target=self._read_replies, daemon=True, name="zygote-replies").start()

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, argv: Sequence[str], env: dict[str, str], log: Path,
             nice: int = 0) -> ForkedServer:
        """Queue one server (`sglang.launch_server <argv>`, appending to `log`); it runs at the
        zygote's niceness and on its CPUs, `nice` is its session's."""
        server = ForkedServer(self, log)
        request = {"argv": list(argv), "env": env, "log": str(log), "nice": nice}
        with self.changed:
            if not self.alive():
                raise ServerStartError(f"the SGLang zygote has exited: {self.describe()}")
            self._queued.append(server)
        try:
            with self._write_lock:
                assert self.process.stdin is not None
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ServerStartError(f"the SGLang zygote has exited: {self.describe()}") from e
        return server

    def returncode_for_unforked(self) -> int:
        """What a server that was never forked reports: the zygote's own exit."""
        code = self.process.poll()
        return code if code is not None and code != 0 else 1

    def describe(self) -> str:
        code = self.process.poll()
        state = "running" if code is None else f"exit code {code}"
        tail = "\n".join(self._stderr) or "(no output)"
        return f"{state}; the end of its output:\n{tail}"

    def close(self, timeout: float = 20.0) -> None:
        """Close its stdin (it kills the servers it forked and exits), then wait for it."""
        with self._write_lock:
            if self.process.stdin is not None and not self.process.stdin.closed:
                with contextlib.suppress(OSError):
                    self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)

    def _read_replies(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            if not raw.startswith(b"{"):  # not a reply (the zygote sends prints to stderr)
                self._stderr.append(raw.decode(errors="replace").rstrip())
                continue
            reply = json.loads(raw)
            with self.changed:
                if reply.get("ready"):
                    self.ready = True
                elif "returncode" in reply:
                    server = self._by_pid.pop(reply["pid"], None)
                    if server is not None:
                        server.returncode = int(reply["returncode"])
                else:
                    server = self._queued.popleft()
                    server.pid = int(reply["pid"])
                    self._by_pid[server.pid] = server
                self.changed.notify_all()
        self.process.wait()
        self._stderr_reader.join(timeout=10)
        with self.changed:  # the zygote is gone, and so are the servers it forked
            code = self.returncode_for_unforked()
            for server in [*self._queued, *self._by_pid.values()]:
                if server.returncode is None and server.pid is None:
                    server.returncode = code
                    with open(server.log, "a") as log:  # where the fleet's error looks
                        log.write(f"The SGLang zygote (pid {self.process.pid}) exited before "
                                  f"forking this server: {self.describe()}\n")
                elif server.returncode is None:
                    server.returncode = -9
            self._queued.clear()
            self._by_pid.clear()
            self.changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            self._stderr.append(raw.decode(errors="replace").rstrip())
