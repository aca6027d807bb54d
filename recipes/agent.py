"""The memory agent trained with GRPO as Mem-alpha does: n rollouts per instance, each reading
the chunks with memory tool calls, then answering the questions from its memory; every action
a gets r_a = r1 + r2_a + beta*r3 + gamma*r4_a, normalised over all actions of the step
(`action_norm`), and its advantage trains that action's tokens.

    python -m areal_like.launcher.local agent [key=value ...]
"""

from __future__ import annotations

from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from areal_like.utils import stats_tracker
from areal_like.utils.fast_exit import exit_now
from recipes.configs import AgentConfig
from workflows import MemoryAgentWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(AgentConfig, "agent_memory.yaml", argv)

    def workflow(rl: RLSetup, greedy: bool = False) -> MemoryAgentWorkflow:
        gconfig = config.gconfig.new(greedy=True, n_samples=1) if greedy else config.gconfig
        agent = config.agent
        return MemoryAgentWorkflow(gconfig, rl.tokenizer, agent.max_steps, agent.beta,
                                   agent.gamma, agent.answerer)

    rl = RLSetup(config, eval_workflow=lambda rl: workflow(rl, greedy=True))
    actor = PPOActor(rl.actor_engine, config.algorithm)
    rl.track_state("actor", actor)  # KL coefficient, running statistics
    train_workflow = workflow(rl)

    def train_step(batch: TensorDict) -> dict[str, float]:
        # QA accuracy, tool success, compression, content quality, mean reward: every row of a
        # rollout holds its values and rollouts have equally many rows
        with stats_tracker.scope("episode"):
            stats_tracker.scalar(**{k: float(batch[k].float().mean())
                                    for k in train_workflow.metric_keys})
        batch["rewards"] = batch["action_rewards"]  # r_a on each action's last token
        return actor.update(actor.compute_advantages(batch))

    rl.train(train_workflow, train_step)


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
