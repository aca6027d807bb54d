"""Run model-written code isolated: bubblewrap (Debian's `bubblewrap`) with every namespace
unshared, as an unprivileged uid, under resource limits.

    sandbox = Sandbox(SandboxLimits(wall_s=10, cpu_s=5))
    result = await sandbox.run_python("print(2 + 3)")      # result.stdout == "5\\n"

What the code gets: a private `/work` holding the files given (a tmpfs of `disk_mb`, the only
writable place besides a private `/tmp` of the same size), a read-only `/usr` (Debian's
Python 3 is `/usr/bin/python3`),
`/proc` and `/dev` of its own. What it does not get: the network (a network namespace of its
own, with no interface up), any other file of the machine (the project, `/root`, `/etc`, the
caller's temporary files), other processes (a pid namespace of its own).

Limits: `memory_mb` of memory and `processes` for the whole run together (a cgroup of its
own, `sandbox_cgroup.py`: its tmpfs files count too; where no cgroup can be made the sandbox
refuses to start, unless `whole_sandbox=False` accepts per-process limits only), and per
process `memory_mb` of address space (RLIMIT_AS), `cpu_s` of CPU time (RLIMIT_CPU), files of
at most `file_mb` (RLIMIT_FSIZE); `wall_s` of wall-clock time, at which its process tree is
killed (bubblewrap's `--die-with-parent`, and the pid namespace ends with its first process).
Output is kept up to `output_kb` per stream. A file name that would leave /work (absolute,
`..`) is refused before anything runs.

Started by root, each run executes as a uid of its own (`fresh_uid`, or the `uid` given):
RLIMIT_NPROC counts the processes of a real uid, so a uid that runs nothing else is what
bounds a fork bomb (root in a user namespace is not bounded by it) — and one uid per run keeps
concurrent runs (an agent per episode, a whole held-out evaluation at once) from using up
each other's process budget. Started by another user, it runs as that user, and `processes`
counts all of that user's processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Optional, Sequence

from areal_like.utils.sandbox_cgroup import RunCgroup, unavailable_reason

SANDBOX_PYTHON = "/usr/bin/python3"  # the system's, under the read-only /usr
UID_BASE = 1 << 24  # sandbox uids: above any system or user account; below 2**31
KILLED_TREE_S = 30.0  # a bound for the killed tree's pipes to close


class SandboxUnavailableError(RuntimeError):
    """bubblewrap (or the tools the sandbox starts it with) is missing on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    file_mb: int = 16
    processes: int = 64
    output_kb: int = 64
    disk_mb: int = 64  # each of /work and /tmp (RAM-backed: within memory_mb too)
    whole_sandbox: bool = True  # False: per-process limits only where no cgroup can be made

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_mb", "processes", "output_kb",
                     "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r} must be > 0")


@dataclass
class SandboxResult:
    exit_code: Optional[int]  # None when killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool = False
    uid: Optional[int] = None  # the uid it ran as (started by root)
    memory_limit_hit: bool = False  # the whole run reached memory_mb (its cgroup's count)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


async def _read_capped(stream: Optional[asyncio.StreamReader], cap: int) -> bytes:
    """The first `cap` bytes of `stream`; the rest is read and dropped (the code must not
    block on a full pipe, nor fill the caller's memory)."""
    if stream is None:
        return b""
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) < cap:
            kept += chunk[:cap - len(kept)]
    return bytes(kept)


_runs = itertools.count()


def fresh_uid() -> int:
    """A uid no other live run uses: this process's pid and a count of its runs (a process
    has fewer than 256 runs at once)."""
    return UID_BASE + (os.getpid() << 8) + (next(_runs) & 0xFF)


def checked_file_name(name: str) -> str:
    """`name` as a path inside /work, or a ValueError naming it (absolute, `..`, empty)."""
    path = PurePosixPath(name) if isinstance(name, str) else None
    if path is None or not name or "\0" in name or path.is_absolute() \
            or ".." in path.parts or not path.parts:
        raise ValueError(f"sandbox file name {name!r}: expected a relative path inside /work "
                         f"(no leading '/', no '..')")
    return str(path)


class Sandbox:
    """Runs commands isolated (see the module doc). Check once with `check()`: a missing
    tool is an error naming its package."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(),
                 uid: Optional[int] = None) -> None:
        self.limits = limits
        self.uid = uid  # None: a fresh one per run
        self.as_root = os.geteuid() == 0

    def check(self) -> None:
        needed = {"bwrap": "bubblewrap", "prlimit": "util-linux"}
        if self.as_root:
            needed["setpriv"] = "util-linux"
        missing = [f"{tool} (Debian package {package})" for tool, package in needed.items()
                   if shutil.which(tool) is None]
        if missing:
            raise SandboxUnavailableError(
                f"the code sandbox needs {', '.join(missing)}: install it, e.g. `apt-get "
                f"install -y bubblewrap`")
        why = unavailable_reason() if self.limits.whole_sandbox else None
        if why:
            raise SandboxUnavailableError(
                f"the code sandbox cannot bound the memory and processes of a whole run here: "
                f"{why}; run as root on a machine with cgroups, or accept per-process limits "
                f"only (SandboxLimits(whole_sandbox=False))")

    def command(self, argv: Sequence[str], files: dict[str, int],
                uid: Optional[int]) -> list[str]:
        """The whole command line that runs `argv` in the sandbox as `uid` (root only), with
        `files` (name in /work -> a descriptor to copy it from) in /work."""
        lim = self.limits
        limits = ["prlimit", f"--cpu={lim.cpu_s}", f"--as={lim.memory_mb * 2**20}",
                  f"--fsize={lim.file_mb * 2**20}", f"--nproc={lim.processes}", "--core=0",
                  "--"]
        user = (["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
                if uid is not None else [])
        bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
                 "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
                 "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
                 "--proc", "/proc", "--dev", "/dev",
                 "--size", str(lim.disk_mb * 2**20), "--tmpfs", "/tmp",
                 "--size", str(lim.disk_mb * 2**20), "--tmpfs", "/work"]
        folders = sorted({str(parent) for name in files
                          for parent in PurePosixPath("/work", name).parents
                          if str(parent).startswith("/work/")})
        for folder in folders:
            bwrap += ["--dir", folder]
        for name, fd in files.items():
            bwrap += ["--file", str(fd), f"/work/{name}"]
        bwrap += ["--chdir", "/work", "--setenv", "HOME", "/work",
                  "--setenv", "PATH", "/usr/bin:/bin", "--"]
        return [*limits, *user, *bwrap, *argv]

    async def run(self, argv: Sequence[str], files: Optional[dict[str, str]] = None
                  ) -> SandboxResult:
        """Run `argv` in a fresh /work holding `files` (name -> text, names relative to
        /work); its result."""
        self.check()
        names = [checked_file_name(name) for name in files or {}]
        descriptors: dict[str, int] = {}
        cgroup: Optional[RunCgroup] = None
        try:
            for name, text in zip(names, (files or {}).values(), strict=True):
                fd = os.memfd_create(f"sandbox:{name}")  # copied into /work by bubblewrap
                descriptors[name] = fd
                os.write(fd, text.encode())
                os.lseek(fd, 0, os.SEEK_SET)
            uid = (self.uid if self.uid is not None else fresh_uid()) if self.as_root else None
            if self.limits.whole_sandbox:
                try:  # a name of its own: runs at once (even as one uid) never share one
                    cgroup = RunCgroup(f"{os.getpid()}_{next(_runs)}",
                                       self.limits.memory_mb * 2**20, self.limits.processes)
                except OSError as e:
                    raise SandboxUnavailableError(
                        f"the code sandbox cannot make this run's cgroup ({e}); "
                        f"SandboxLimits(whole_sandbox=False) accepts per-process limits "
                        f"only") from e
            result = await self._run(self.command(argv, descriptors, uid), cgroup,
                                     tuple(descriptors.values()))
            result.uid = uid
            result.memory_limit_hit = cgroup is not None and cgroup.hit_memory_limit()
            return result
        finally:
            for fd in descriptors.values():
                os.close(fd)
            if cgroup is not None:
                cgroup.close()

    async def run_python(self, code: str) -> SandboxResult:
        """Run Python source with the system's Python 3, isolated."""
        return await self.run([SANDBOX_PYTHON, "main.py"], {"main.py": code})

    async def _run(self, command: list[str], cgroup: Optional[RunCgroup],
                   pass_fds: tuple[int, ...]) -> SandboxResult:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # nothing of the caller's
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, pass_fds=pass_fds,
            preexec_fn=cgroup.enter if cgroup is not None else None)
        cap = self.limits.output_kb * 1024
        reads = asyncio.gather(_read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap),
                               proc.wait())
        timed_out = False
        try:
            out, err, _ = await asyncio.wait_for(asyncio.shield(reads), self.limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            try:  # the pipes close with the process tree (pid namespace, die-with-parent)
                out, err, _ = await asyncio.wait_for(reads, KILLED_TREE_S)
            except asyncio.TimeoutError:
                raise RuntimeError(f"the sandbox's process tree (pid {proc.pid}) outlived its "
                                   f"kill by {KILLED_TREE_S:g} s") from None
        return SandboxResult(None if timed_out else proc.returncode,
                             out.decode(errors="replace"), err.decode(errors="replace"),
                             timed_out)
