"""An exception anywhere in a run ends the whole run within seconds, with that exception as the
last thing on screen and a non-zero exit code: the local launcher runs a user's script
(`failing_trainer.py`) on the session's SGLang fleet, failing at each place a trainer can
fail (the Ray launcher's cases are in test_ray_launcher.py). The bound starts when the
exception is printed (an event), so a slow machine cannot fail the test, and a run that never
ends can."""

from __future__ import annotations

import os
import sys

import pytest
from bad_run_helpers import FAULTS, failing_run_args, processes_naming, run_until_exit
from sglang_helpers import attach_args

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


@pytest.mark.parametrize("where,overrides,needle", FAULTS, ids=[f[0] for f in FAULTS])
def test_an_exception_anywhere_ends_the_run_with_it_last_on_screen(
        fresh_fleet, tiny_model_dir, tmp_path, where, overrides, needle):
    log_dir = tmp_path / f"runs_{where}"
    cmd = [sys.executable, "-m", "areal_like.launcher.local",
           *failing_run_args(where, tiny_model_dir, log_dir,
                             [*attach_args(fresh_fleet), *overrides])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code, lines = run_until_exit(cmd, env, needle)
    last = [line for line in lines if line.strip()][-1]
    assert code != 0 and "trainer exited with code" in last and needle in last, last
    assert not processes_naming(str(log_dir)), processes_naming(str(log_dir))
