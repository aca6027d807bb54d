"""A tool-using memory agent trained with RL: it reads chunks, writes memory with tool calls,
answers questions from memory; per-action rewards sit on its action tokens.

    python -m areal_like.launcher.local agent [key=value ...]
"""

from __future__ import annotations

from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.algorithms.rewards import place_at_last_token
from areal_like.runtime.cli import parse_recipe_args
from areal_like.runtime.evaluation import record_episode_metrics
from areal_like.runtime.rl_setup import RLSetup
from recipes.configs import AgentConfig
from workflows import MemoryAgentWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(AgentConfig, "agent_memory.yaml", argv)

    def workflow(rl: RLSetup, greedy: bool = False) -> MemoryAgentWorkflow:
        return MemoryAgentWorkflow(config.gconfig.new(greedy=greedy), rl.tokenizer,
                                   config.max_steps, config.beta, config.gamma)

    rl = RLSetup(config, eval_workflow=lambda rl: workflow(rl, greedy=True))
    actor = PPOActor(rl.actor_engine, config.algorithm)  # dense action rewards + outcome
    train_workflow = workflow(rl)

    def train_step(batch: TensorDict) -> dict[str, float]:
        record_episode_metrics(batch, train_workflow.metric_keys)  # QA accuracy, tool success
        # per-action rewards on action tokens + the episode outcome on the last token
        loss_mask = batch["loss_mask"].bool()
        batch["rewards"] = (batch["action_rewards"] * loss_mask
                            + place_at_last_token(batch["outcome_rewards"], loss_mask))
        batch["prox_logp"] = actor.compute_logp(batch)
        return actor.update(actor.compute_advantages(batch))

    rl.train(train_workflow, train_step)


if __name__ == "__main__":
    main()
