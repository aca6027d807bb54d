"""A spawned child (the rollout controller) starts without the parent's program and imports
it, as multiprocessing would have, only when an object the program defines reaches it.
Starts two small Python programs (about a second each); no server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import sys
from areal_like.utils.spawn_main import import_program_on_first_use

def child(conn, program):
    import_program_on_first_use(program)
    main = sys.modules["__main__"]
    conn.send(("started", vars(main).get("PROGRAM_RAN", False)))
    while (obj := conn.recv()) is not None:
        main = sys.modules["__main__"]
        value = obj.value() if hasattr(obj, "value") else obj
        conn.send(("got", type(obj).__name__, value, vars(main).get("PROGRAM_RAN", False)))
"""

PROGRAM = """
import multiprocessing as mp
from child_mod import child
from areal_like.utils.spawn_main import children_skip_the_program

PROGRAM_RAN = True  # in a child: set only once the program was imported there

class Payload:
    def value(self):
        return 42

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    with children_skip_the_program() as program:
        process = ctx.Process(target=child, args=(theirs, program))
        process.start()
    assert __file__, "the parent's own __main__ is left as it was"

    def answer():
        assert mine.poll(60), "the child did not answer"
        return mine.recv()

    print(answer())
    mine.send(7)  # an int: the program is not needed for it
    print(answer())
    mine.send(Payload())
    print(answer())
    mine.send(None)
    process.join(timeout=60)
    print("exit", process.exitcode)
"""


def _run(tmp_path: Path, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=180, env={"PYTHONPATH": f"{REPO}:{tmp_path}",
                                           "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_program_is_imported_in_the_child_only_when_an_object_of_it_arrives(tmp_path):
    (tmp_path / "child_mod.py").write_text(textwrap.dedent(CHILD))
    package = tmp_path / "prog"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(textwrap.dedent(PROGRAM))
    (tmp_path / "script.py").write_text(textwrap.dedent(PROGRAM))
    for args in (["script.py"], ["-m", "prog.main"]):  # found by its path, and by its name
        lines = _run(tmp_path, *args)
        assert lines[0] == "('started', False)", (args, lines)  # not imported at start
        assert lines[1] == "('got', 'int', 7, False)", (args, lines)  # still not imported
        assert lines[2] == "('got', 'Payload', 42, True)", (args, lines)  # imported for it
        assert lines[3] == "exit 0", (args, lines)
