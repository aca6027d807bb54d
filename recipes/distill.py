"""On-policy distillation: the student (the policy) samples on its fleet, a teacher fleet
scores every sampled token, and the per-token reverse KL is the reward (plus the task's).

    python -m areal_like.launcher.local distill [key=value ...]   # starts both fleets
    torchrun -m recipes.distill rollout.server_addrs=[...] teacher.server_addrs=[...] ...

Teacher and student share the tokenizer. The teacher takes the place of the KL reference:
with the `distill` preset (GRPO on the task reward, kl.in_reward with the k1 estimator,
kl.discount 0) every token t gets A_t = A_task - kl.coef * (log p_student - log p_teacher)_t,
its own per-token reward beside the task's advantage (kl.discount 1 would give it the sum over
t' >= t instead: a return, which a shorter answer lowers). With the `distill_full` preset and
teacher.top_k > 0 the teacher sends its k most likely next tokens at every position and the
loss takes the exact reverse KL to that distribution at each sampled position instead.

A teacher fleet that does not answer stops the run before training (every rank checks it,
within `rollout.client.setup_timeout`), naming `teacher.server_addrs` (`TeacherUnavailableError`).
"""

from __future__ import annotations

import dataclasses
import functools

from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.algorithms.functional import shift_to_next_token
from areal_like.api.config import RolloutConfig
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from areal_like.utils.fast_exit import exit_now
from engines.fleet.client import RemoteInferenceEngine
from engines.server.errors import InferenceServerError
from recipes.configs import DistillConfig
from workflows.distill import DistillWorkflow, TeacherScorer, TeacherUnavailableError


def teacher_client(config: DistillConfig) -> RolloutConfig:
    """The teacher fleet's client settings: the student's (backend, API key, set-up timeout),
    the teacher's addresses and request timeout."""
    return dataclasses.replace(
        config.rollout, server_addrs=config.teacher.server_addrs,
        client=dataclasses.replace(config.rollout.client,
                                   request_timeout=config.teacher.request_timeout),
        weights=dataclasses.replace(config.rollout.weights, transport="disk"))


def connect_teacher(config: RolloutConfig) -> RemoteInferenceEngine:
    """A started client of the teacher fleet (its weights never change: version 0; its
    backend is the student fleet's: the launcher serves both with `server`). Fails within
    `rollout.client.setup_timeout` (plus one health probe) naming `teacher.server_addrs`."""
    engine = RemoteInferenceEngine(config)
    try:
        engine.initialize()
    except (InferenceServerError, TimeoutError) as e:
        raise TeacherUnavailableError(
            f"teacher.server_addrs={config.server_addrs}: the teacher fleet does not answer "
            f"({e}); serve the teacher there, or give the addresses of its servers") from e
    return engine


def check_teacher(config: DistillConfig) -> None:
    """Before anything slow starts (and before any training): every teacher server answers,
    or TeacherUnavailableError naming `teacher.server_addrs` and the address."""
    connect_teacher(teacher_client(config)).destroy()


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(DistillConfig, "distill_addition.yaml", argv)
    if not config.teacher.server_addrs:
        raise SystemExit("distill: teacher.server_addrs is empty: run through the local "
                         "launcher (it serves teacher.model_path), or serve the teacher "
                         "(python -m engines.fleet.serve --model-path DIR) and pass its "
                         "addresses")
    # every rank checks (a /health call each), so every rank fails alike, before RLSetup
    check_teacher(config)
    rl = RLSetup(config)
    actor = PPOActor(rl.actor_engine, config.algorithm, ref_in_batch=True)  # the teacher
    teacher = (TeacherScorer(functools.partial(connect_teacher, teacher_client(config)),
                             config.teacher.request_timeout, config.teacher.top_k,
                             config.teacher.server_addrs)
               if rl.run.is_main else None)
    workflow = DistillWorkflow(rl.task.reward_fn, config.gconfig, rl.tokenizer, teacher,
                               config.teacher.use_task_reward)

    def train_step(batch: TensorDict) -> dict[str, float]:
        # the teacher is the KL reference: log-probs of each next token, as compute_logp's
        batch["ref_logp"] = shift_to_next_token(batch["teacher_logprobs"])
        if "teacher_top_ids" in batch.keys():  # kl.estimator=full: the teacher's distribution
            batch["ref_top_ids"] = shift_to_next_token(batch["teacher_top_ids"])
            batch["ref_top_logp"] = shift_to_next_token(batch["teacher_top_logprobs"])
        batch = actor.compute_advantages(batch)  # task advantage - KL-to-teacher return
        return actor.update(batch)

    rl.train(workflow, train_step)


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
