"""The code sandbox (bubblewrap, an unprivileged uid, resource limits): model-written code
cannot read a file outside its directory, reach a socket of this machine, write outside
/work, fork-bomb the machine, or outlive its CPU or wall-clock limit; the caller goes on.
Real bubblewrap processes; skipped without bubblewrap except in CI (CI=true), where
scripts/install.sh installs it."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from areal_like.utils.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(SandboxLimits(wall_s=60, cpu_s=1, processes=16))
    try:
        box.check()
    except SandboxUnavailableError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the sandbox tests: {e}")
        pytest.skip(str(e))
    return box


def _python(box: Sandbox, code: str):
    return asyncio.run(box.run_python(code))


async def _two_at_once(box: Sandbox):
    return await asyncio.gather(box.run_python("import os\nprint(os.getuid())"),
                                box.run_python("import os\nprint(os.getuid())"))


def _sandbox_uid_processes(uid: int) -> list[int]:
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue
        uids = next((line.split()[1:] for line in lines if line.startswith("Uid:")), [])
        state = next((line.split()[1] for line in lines if line.startswith("State:")), "")
        if uids and int(uids[0]) == uid and state != "Z":
            pids.append(int(status.parent.name))
    return pids


def test_code_runs_in_its_own_directory_as_an_unprivileged_user(sandbox):
    result = _python(sandbox, "import os\nopen('out.txt', 'w').write('5')\n"
                              "print(os.getcwd(), os.getuid(), sorted(os.listdir('/')), "
                              "open('out.txt').read())")
    assert result.ok, result.stderr
    cwd, uid, rest = result.stdout.split(" ", 2)
    assert cwd == "/work"
    assert int(uid) == (result.uid if os.geteuid() == 0 else os.getuid())
    if os.geteuid() == 0:  # a uid per run: runs at once do not share their process budget
        first, second = asyncio.run(_two_at_once(sandbox))
        assert first.ok and second.ok and first.stdout != second.stdout
        assert {int(first.stdout), int(second.stdout)} == {first.uid, second.uid}
    assert rest == "['bin', 'dev', 'lib', 'lib64', 'proc', 'tmp', 'usr', 'work'] 5\n"


def test_files_outside_its_directory_cannot_be_read_or_written(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the caller's")
    for path in (secret, REPO / "README.md", Path("/etc/passwd"), Path.home()):
        result = _python(sandbox, f"print(open({str(path)!r}).read())")
        assert result.exit_code == 1 and "No such file or directory" in result.stderr, path
        assert "the caller's" not in result.stdout
    written = _python(sandbox, "open('/usr/bin/x', 'w')")
    assert written.exit_code == 1 and "Read-only file system" in written.stderr


def test_no_socket_of_this_machine_can_be_reached(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        result = _python(sandbox, "import socket\n"
                                  f"socket.create_connection(('127.0.0.1', {port}), timeout=5)")
        assert result.exit_code == 1 and "Connection refused" in result.stderr, result.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nobody connected
            server.accept()
    dns = _python(sandbox, "import socket\nsocket.getaddrinfo('pypi.org', 443)")
    assert dns.exit_code == 1 and "socket.gaierror" in dns.stderr


def test_limits_end_a_busy_loop_a_sleep_a_fork_bomb_and_a_memory_hog(sandbox):
    busy = _python(sandbox, "while True: pass")  # 1 s of CPU: killed by RLIMIT_CPU
    assert busy.exit_code == 128 + 9 and not busy.timed_out
    hog = _python(sandbox, "x = bytearray(4 * 1024 ** 3)")
    assert hog.exit_code == 1 and "MemoryError" in hog.stderr
    short = Sandbox(SandboxLimits(wall_s=2, cpu_s=30, processes=16))
    start = time.monotonic()
    sleep = _python(short, "import time\ntime.sleep(600)")
    assert sleep.timed_out and sleep.exit_code is None
    bomb = _python(short, "import os\nwhile True:\n    try:\n        os.fork()\n"
                          "    except OSError:\n        pass")
    assert bomb.timed_out  # bounded by RLIMIT_NPROC until the wall-clock limit
    assert time.monotonic() - start < 300  # bounds for a hang, not the expected time
    if os.geteuid() == 0:  # nothing of the bomb's uid is left
        deadline = time.monotonic() + 60
        while _sandbox_uid_processes(bomb.uid):
            assert time.monotonic() < deadline, _sandbox_uid_processes(bomb.uid)
            time.sleep(0.1)
    assert _python(sandbox, "print('still fine')").stdout == "still fine\n"


def test_a_missing_bubblewrap_is_named_with_its_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without it
    with pytest.raises(SandboxUnavailableError, match=r"bwrap \(Debian package bubblewrap\)"):
        Sandbox().check()
    with pytest.raises(ValueError, match="SandboxLimits.wall_s=0"):
        SandboxLimits(wall_s=0)


def test_the_python_tool_answers_a_registry_call_and_survives_a_fork_bomb(sandbox):
    from workflows.code_tool import python_tool
    from workflows.tools import ToolCall, ToolRegistry

    registry = ToolRegistry(timeout=120)
    short = Sandbox(SandboxLimits(wall_s=2, cpu_s=30, processes=16))
    registry.register(python_tool(short), name="python")
    ok = asyncio.run(registry.call(ToolCall("python", {"code": "print(6 * 7)"})))
    assert ok.ok and ok.content == {"exit_code": 0, "stdout": "42\n", "stderr": ""}
    bomb = asyncio.run(registry.call(ToolCall("python", {
        "code": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                "        pass"})))
    assert not bomb.ok and "still ran after 2 s and was killed" in bomb.content
    again = asyncio.run(registry.call(ToolCall("python", {"code": "print('next')"})))
    assert again.ok and again.content["stdout"] == "next\n"


def test_the_whole_run_is_bounded_not_each_process(sandbox):
    """Memory is counted for every process of a run together (its cgroup), RAM-backed files
    of /tmp and /work included; each tmpfs is disk_mb."""
    box = Sandbox(SandboxLimits(wall_s=60, cpu_s=30, memory_mb=512, processes=16, disk_mb=16))
    children = _python(box, "import os, sys, time\npids = []\nfor _ in range(5):\n"
                            "    pid = os.fork()\n    if pid == 0:\n"
                            "        x = b'x' * (300 * 2 ** 20)\n        time.sleep(3)\n"
                            "        os._exit(0)\n    pids.append(pid)\n"
                            "codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) "
                            "for p in pids]\nprint(codes)")
    # five children of 300 MB each fit RLIMIT_AS one by one, not 512 MB together
    assert children.memory_limit_hit, (children.stdout, children.stderr)
    assert children.stdout.strip() != "[0, 0, 0, 0, 0]", children.stdout
    for folder in ("/tmp", "/work"):  # files of 10 MB (under file_mb) until the tmpfs is full
        full = _python(box, f"for i in range(4):\n"
                            f"    open('{folder}/f%d' % i, 'wb').write(b'x' * (10 * 2 ** 20))")
        assert full.exit_code == 1 and "No space left on device" in full.stderr, full.stderr
    assert _python(box, "print('next run')").stdout == "next run\n"


def test_no_caller_path_leaves_work_and_nothing_of_the_caller_is_seen(sandbox, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("AREAL_LIKE_TEST_SECRET", "s3cret")
    for name in ("../x", "/etc/x", "a/../../x", "", "sub/\0x"):
        with pytest.raises(ValueError, match="expected a relative path inside /work"):
            asyncio.run(sandbox.run(["/usr/bin/true"], files={name: "escape"}))
    assert not (tmp_path.parent / "x").exists()
    nested = asyncio.run(sandbox.run(
        ["/usr/bin/python3", "pkg/main.py"],
        files={"pkg/main.py": "import os, mod\nprint(mod.VALUE, "
                              "'s3cret' in str(os.environ), len([p for p in os.listdir('/proc')"
                              " if p.isdigit()]))\n",
               "pkg/__init__.py": "", "pkg/mod.py": "VALUE = 7\n"}))
    value, leaked, processes = nested.stdout.split()
    assert value == "7" and leaked == "False", nested.stderr
    assert int(processes) <= 3  # its own pid namespace: bubblewrap and itself
    link = _python(sandbox, "import os\nos.symlink('/etc/passwd', 'p')\nprint(open('p').read())")
    assert link.exit_code == 1 and "No such file or directory" in link.stderr


def test_a_machine_that_cannot_bound_the_whole_run_is_refused(monkeypatch, tmp_path):
    from areal_like.utils import sandbox_cgroup

    monkeypatch.setattr(sandbox_cgroup, "ROOT", tmp_path)  # no cgroup controllers there
    if not Path("/usr/bin/bwrap").exists() and os.environ.get("CI", "").lower() != "true":
        pytest.skip("bubblewrap is missing")
    with pytest.raises(SandboxUnavailableError, match="cannot bound the memory and processes "
                                                      "of a whole run here"):
        Sandbox().check()
    Sandbox(SandboxLimits(whole_sandbox=False)).check()  # per-process limits, accepted
