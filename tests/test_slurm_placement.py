"""The Slurm launcher's arithmetic, without a Slurm: where servers and ranks go, the batch
script's request, a finished job's exit code, a task's torch.distributed environment (the
launcher against a real Slurm: tests/test_slurm_launcher.py)."""

from __future__ import annotations

import shlex

import pytest

from areal_like.api.config_loader import load_config
from areal_like.launcher.slurm import batch_script
from areal_like.launcher.slurm_commands import exit_code
from areal_like.launcher.slurm_job import place
from areal_like.launcher.slurm_task import rank_environment
from areal_like.launcher.target import LaunchError, resolve_target
from recipes.configs import GRPOConfig

NODES = ["a", "b", "c"]


def _config(*overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, "recipes/conf/grpo_addition.yaml", list(overrides))


@pytest.mark.parametrize("overrides, nodes, servers, trainer, per_node", [
    # servers on the first node, the ranks on the others
    (["launcher.slurm.nodes=3", "launcher.slurm.server_nodes=1", "server.n_servers=3",
      "launcher.n_trainer_procs=4"], NODES, {"a": 3}, ["b", "c"], 2),
    # shared nodes: servers over every node, the ranks over as many as split them evenly
    (["server.n_servers=4", "launcher.n_trainer_procs=4"], NODES[:2], {"a": 2, "b": 2},
     ["a", "b"], 2),
    (["server.n_servers=2", "launcher.n_trainer_procs=3"], NODES[:2], {"a": 1, "b": 1},
     ["a"], 3),
    (["server.n_servers=1", "launcher.n_trainer_procs=1"], NODES[:1], {"a": 1}, ["a"], 1),
])
def test_servers_and_ranks_go_where_the_keys_say(overrides, nodes, servers, trainer, per_node):
    placement = place(_config(*overrides), nodes, needs_fleet=True)
    assert dict(zip(placement.server_nodes, placement.servers_per_node, strict=True)) == servers
    assert (placement.trainer_nodes, placement.ranks_per_node) == (trainer, per_node)
    assert sum(placement.servers_per_node) == _config(*overrides).server.n_servers


def test_a_placement_that_does_not_fit_is_refused_naming_the_key():
    uneven = _config("launcher.slurm.nodes=3", "launcher.slurm.server_nodes=1",
                     "launcher.n_trainer_procs=3")
    with pytest.raises(LaunchError, match="launcher.n_trainer_procs=3 does not split evenly"):
        place(uneven, NODES, needs_fleet=True)
    # an allocation smaller than asked for (salloc -N1 with server_nodes=1)
    with pytest.raises(LaunchError, match="server_nodes=1 leaves none"):
        place(_config("launcher.slurm.nodes=2", "launcher.slurm.server_nodes=1"), NODES[:1],
              needs_fleet=True)
    # no fleet to start (rollout.server_addrs given): every node is the trainer's
    fleetless = place(_config("launcher.n_trainer_procs=2"), NODES[:2], needs_fleet=False)
    assert (fleetless.server_nodes, fleetless.trainer_nodes) == ([], ["a", "b"])


def test_the_batch_script_asks_for_a_task_per_rank_and_runs_the_launcher_again(tmp_path):
    args = ["grpo", f"logging.log_dir={tmp_path / 'a dir'}", "launcher.slurm.nodes=2",
            "launcher.slurm.server_nodes=1", "launcher.n_trainer_procs=4",
            "launcher.slurm.max_requeues=2", "checkpoint.recover=auto",
            "launcher.slurm.partition=gpu", "launcher.slurm.sbatch_args=[--exclusive]"]
    script = batch_script(resolve_target(args[0], args[1:]), args, tmp_path)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--nodes=2", "--ntasks-per-node=4", "--requeue", "--partition=gpu",
                   "--exclusive", f"--output={tmp_path}/job-%j.out"):
        assert f"#SBATCH {option}" in lines, (option, script)
    command = shlex.split(lines[-1])  # the path with a space comes back whole
    assert command[0] == "exec" and command[2:5] == ["-m", "areal_like.launcher.slurm", "grpo"]
    assert command[5:] == args[1:]


@pytest.mark.parametrize("state, code", [
    ({"JobState": "COMPLETED", "ExitCode": "0:0"}, 0),
    ({"JobState": "FAILED", "ExitCode": "3:0"}, 3),
    ({"JobState": "FAILED", "ExitCode": "0:9"}, 137),  # killed by signal 9
    ({"JobState": "CANCELLED", "ExitCode": "0:0"}, 1),  # cancelled: never a success
    ({"JobState": "TIMEOUT", "ExitCode": "0:0"}, 1),
])
def test_a_finished_jobs_exit_code(state, code):
    assert exit_code(state) == code


def test_a_tasks_rank_comes_from_its_slurm_step():
    slurm = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
             "SLURM_STEP_NUM_NODES": "2"}
    assert rank_environment(slurm) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                       "LOCAL_WORLD_SIZE": "4"}
    # Slurm bound the task to one GPU: it is device 0 of what the task sees
    bound = rank_environment({**slurm, "CUDA_VISIBLE_DEVICES": "3"})
    assert bound["LOCAL_RANK"] == "0"
    assert rank_environment({**slurm, "CUDA_VISIBLE_DEVICES": "0,1,2,3"})["LOCAL_RANK"] == "1"
