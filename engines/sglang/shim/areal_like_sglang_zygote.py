"""One interpreter that imports SGLang once and forks each server of a fleet from it.

`python -m areal_like_sglang_zygote` (venv-local, see README.md) imports what every
`sglang.launch_server` process imports (~10 s of one core on a small CPU machine, most of a
server's start), prints `{"ready": true}`, then reads one JSON request per line from stdin:

    {"argv": [...launch_server arguments...], "env": {...}, "log": PATH, "nice": 0}

and answers each, in order, with `{"pid": PID}` once the server is forked: the child runs
`sglang.launch_server` as its `__main__` would, in a session of its own (the fleet stops it
by its process group), stdout and stderr appended to `log`, its environment replaced by
`env`, its niceness and CPUs the zygote's (`nice`: its session's autogroup niceness). When a
server exits, the zygote reaps it and prints `{"pid": PID, "returncode": N}` (negative:
killed by signal -N, as `subprocess.Popen` says it). When stdin closes, it kills
every server it forked and exits; each server dies with it (PR_SET_PDEATHSIG, SIGKILL), as
it dies with the process that started it (the fleet sets that up).

CPU engine only: a fork after SGLang's imports is safe where CUDA was never initialised (the
same condition as `ServerConfig.fork_children`, which forks each server's scheduler and
detokenizer the same way).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import re
import select
import signal
import sys
import traceback
from typing import Any

_PR_SET_PDEATHSIG = 1
# the architectures of the fleet's model (its config.json), comma-separated; set by the fleet
SERVED_ARCHITECTURES_ENV = "AREAL_LIKE_SGLANG_ARCHITECTURES"
_ENTRY_CLASS = re.compile(r"^EntryClass\s*=\s*(\[[^\]]*\]|.*)$", re.MULTILINE)


def unserved_model_modules(models_dir: str, served: list[str]) -> list[str]:
    """The model modules of `models_dir` whose `EntryClass` names none of `served` (the
    architectures SGLang looks up by name); [] when no module names one of them (then every
    module is imported, as without this)."""
    unserved, found = [], False
    for name in sorted(os.listdir(models_dir)):
        if not name.endswith(".py") or name.startswith("_"):
            continue
        with open(os.path.join(models_dir, name), encoding="utf-8", errors="replace") as f:
            entry = " ".join(_ENTRY_CLASS.findall(f.read()))
        if not entry:
            continue  # no model class: SGLang's registry skips it anyway
        if set(re.findall(r"\w+", entry)) & set(served):
            found = True
        else:
            unserved.append(name[:-3])
    return unserved if found else []


def _import_only_the_served_models() -> None:
    """SGLang's model registry imports all of its ~220 model modules (~1.3 s of one core here);
    every server of a fleet serves one model, so the others are skipped with SGLang's own
    `SGLANG_DISABLED_MODEL_ARCHS` (unless the user set it)."""
    served = [a for a in os.environ.get(SERVED_ARCHITECTURES_ENV, "").split(",") if a]
    spec = importlib.util.find_spec("sglang")  # (imports nothing)
    if not served or "SGLANG_DISABLED_MODEL_ARCHS" in os.environ or spec is None \
            or not spec.origin:
        return
    models_dir = os.path.join(os.path.dirname(spec.origin), "srt", "models")
    skip = unserved_model_modules(models_dir, served) if os.path.isdir(models_dir) else []
    if skip:
        os.environ["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(skip)


def _import_what_every_server_imports() -> None:
    import sglang.launch_server  # noqa: F401
    import sglang.srt.entrypoints.http_server  # noqa: F401
    import sglang.srt.managers.detokenizer_manager  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.models.registry  # noqa: F401  (imports every model class, ~1.3 s)


def _die_with(parent_pid: int) -> None:
    """SIGKILL, not SIGTERM, when the zygote dies: SGLang's own SIGTERM handler was seen to
    stop the scheduler and then hang (a server orphaned for good); its scheduler and
    detokenizer die with it by their own PR_SET_PDEATHSIG."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _run_server(request: dict[str, Any], zygote_pid: int, wakeup_fds: tuple[int, int],
                in_session: int) -> None:
    """In the forked child: become `python -m sglang.launch_server <argv>`; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in wakeup_fds:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # its own process group: the fleet stops it and its children together
        _die_with(zygote_pid)
        os.write(in_session, b"1")  # the zygote names the pid only now: killpg(pid) works
        os.close(in_session)
        # its niceness and CPUs are the zygote's; a new session is a new autogroup, whose
        # niceness Linux shares the CPU by first
        if request.get("nice") and os.path.exists("/proc/self/autogroup"):
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(int(request["nice"])))
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.argv[0], *request["argv"]]
        import runpy

        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_REPLIES: list[Any] = []  # the fleet's pipe; fd 1 is pointed at stderr (stray prints)


def _say(message: dict[str, Any]) -> None:
    _REPLIES[0].write(json.dumps(message) + "\n")
    _REPLIES[0].flush()


def _reap(servers: set[int]) -> None:
    while servers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        servers.discard(pid)
        _say({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def main() -> None:
    # replies on a descriptor of their own: whatever an import prints goes to stderr
    _REPLIES.append(os.fdopen(os.dup(1), "w"))
    os.dup2(2, 1)
    _import_only_the_served_models()
    _import_what_every_server_imports()
    servers: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    stdin = sys.stdin.fileno()
    pending = b""
    _say({"ready": True})
    try:
        while True:
            readable, _, _ = select.select([stdin, wake_r], [], [])
            if wake_r in readable:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                _reap(servers)
            if stdin in readable:
                chunk = os.read(stdin, 1 << 16)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    in_session_r, in_session_w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        os.close(in_session_r)
                        os.close(_REPLIES[0].fileno())
                        _run_server(request, os.getppid(), (wake_r, wake_w), in_session_w)
                    os.close(in_session_w)
                    os.read(in_session_r, 1)  # empty if the child died first: reaped below
                    os.close(in_session_r)
                    servers.add(pid)
                    _say({"pid": pid})
    finally:
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
    # every server is killed and nothing is left to save: skip the interpreter's teardown of
    # all of SGLang and torch (~2 s of a fleet's stop, at the end of every run)
    sys.stderr.flush()
    os._exit(0)
