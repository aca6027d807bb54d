"""An agent program trained with the GRPO family: any command, run once per episode with
the trainer's gateway as its OpenAI / Anthropic endpoint (workflows/program.py); its verifier
gives the reward, and held-out evaluation runs the same program with greedy decoding.

    python -m areal_like.launcher.local agent_program [key=value ...]
    # default: the calculator agent (examples/calculator_agent), warm-started by
    # python -m areal_like.launcher.local sft --config recipes/conf/sft_calculator.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

from tensordict import TensorDict

from areal_like.algorithms import PPOActor, dynamic_sampling_filter
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from areal_like.utils.fast_exit import exit_now
from recipes.configs import ProgramRecipeConfig
from workflows.program import ProgramWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(ProgramRecipeConfig, "agent_program_calculator.yaml", argv)
    program = config.program
    # the program runs in this environment, in a work directory of its own: files named
    # relative to where the run started are given to it by their full path
    command = [sys.executable if i == 0 and arg in ("python", "python3") else
               str(Path(arg).resolve()) if i and Path(arg).is_file() else arg
               for i, arg in enumerate(program.command)]

    def workflow(rl: RLSetup, greedy: bool = False) -> ProgramWorkflow:
        gconfig = config.gconfig.new(greedy=True, n_samples=1) if greedy else config.gconfig
        return ProgramWorkflow(command, program.verifier, gconfig, rl.tokenizer,
                               timeout_s=program.timeout_s, turn_discount=program.turn_discount,
                               export_style=program.export_style)

    rl = RLSetup(config, eval_workflow=lambda rl: workflow(rl, greedy=True))
    actor = PPOActor(rl.actor_engine, config.algorithm)
    rl.track_state("actor", actor)

    def train_step(batch: TensorDict) -> dict[str, float]:
        return actor.update(actor.compute_advantages(batch))

    rl.train(workflow(rl), train_step, should_accept=dynamic_sampling_filter(config.algorithm))


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
