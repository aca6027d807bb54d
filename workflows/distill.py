"""On-policy distillation's rollout: the student samples, a teacher scores every sampled token.

Each row carries the teacher's log-probs of the completion's own token ids,
`teacher_logprobs` [1, L] (token alignment like `logprobs`: 0 on prompt tokens), fetched from
the teacher fleet with one prefill per group (`InferenceEngine.ascore_top_batch`), never from
text; with the scorer's `top_k` > 0 also the teacher's k most likely tokens at each completion
position, `teacher_top_ids` / `teacher_top_logprobs` [1, L, k] (the distribution of token t
given the tokens before it; 0 on prompt tokens). `rewards` is the task verifier's outcome
reward (0.0 for every row when `use_task_reward` is off). The trainer turns the log-probs into
the per-token reward -(log p_student - log p_teacher), or with top-k into the exact per-position
reverse KL in the loss: the teacher is the actor's KL reference (recipes/distill.py).
Metric: `distill/reverse_kl`, the sampled per-token reverse KL (sampler's log-prob minus the
teacher's), mean over completions.

The teacher follows the reward rules: a scoring call that fails or times out makes that
sample a `RewardFailure` named "teacher" (excluded, counted under `reward/teacher/...`, and
past `reward.max_failure_rate` the run stops); it is never scored 0.0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, ModelResponse
from areal_like.api.io_struct import TokenScores
from areal_like.rewards.failures import RewardFailure
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.utils import stats_tracker
from areal_like.utils.chat import decode_text
from workflows.common import stable_id
from workflows.rlvr import RLVRWorkflow

TEACHER = "teacher"  # the reward name its calls are counted and budgeted under


class TeacherUnavailableError(RuntimeError):
    """The teacher fleet (`teacher.server_addrs`) cannot be reached or does not answer."""


class TeacherScorer:
    """The teacher fleet's client, started on first use where episodes run (the rollout
    process): `connect()` returns a started `InferenceEngine`; `top_k` > 0 also fetches the
    teacher's k most likely tokens at every scored position; `addresses` name the fleet in
    errors. Pickles as its recipe."""

    def __init__(self, connect: Callable[[], InferenceEngine], timeout: float,
                 top_k: int = 0, addresses: Sequence[str] = ()) -> None:
        self.connect, self.timeout, self.top_k = connect, timeout, top_k
        self.addresses = list(addresses)
        self._reset()

    def _reset(self) -> None:
        self._engine: Optional[InferenceEngine] = None
        self._connecting: Optional[concurrent.futures.Future[InferenceEngine]] = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"connect": self.connect, "timeout": self.timeout, "top_k": self.top_k,
                "addresses": self.addresses}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.connect, self.timeout = state["connect"], state["timeout"]
        self.top_k, self.addresses = state["top_k"], state["addresses"]
        self._reset()

    @property
    def where(self) -> str:
        return f"teacher.server_addrs={self.addresses}" if self.addresses else "the teacher"

    def _connection(self) -> concurrent.futures.Future[InferenceEngine]:
        """The started client, or the one attempt to start it that every episode waits on.
        It runs in a daemon thread: episodes queued behind a fleet that does not answer share
        its failure instead of each retrying for the whole set-up timeout in turn, and the
        process can exit while it runs (an executor thread would be joined at exit)."""
        with self._lock:
            attempt = self._connecting
            if attempt is None or (attempt.done() and attempt.exception() is not None):
                attempt = self._connecting = concurrent.futures.Future()
                attempt.set_running_or_notify_cancel()  # a cancelled waiter cannot cancel it
                threading.Thread(target=self._connect, args=(attempt,), daemon=True,
                                 name="teacher-connect").start()
            return attempt

    def _connect(self, attempt: concurrent.futures.Future[InferenceEngine]) -> None:
        try:
            engine = self.connect()
        except BaseException as e:  # noqa: BLE001 - handed to every episode that waits on it
            attempt.set_exception(e)
            return
        with self._lock:
            current = self._connecting is attempt
            if current:
                self._engine = engine
        if current:
            attempt.set_result(engine)
            return
        engine.destroy()  # closed while it connected: nobody may use it
        attempt.set_exception(TeacherUnavailableError(
            f"the client of {self.where} was closed while it connected"))

    async def score(self, sequences: list[list[int]], starts: list[int]) -> list[TokenScores]:
        """Per sequence, the teacher's log p(ids[t] | ids[:t]) for t >= start, and its top-k
        tokens there (one request)."""
        engine = await asyncio.wrap_future(self._connection())  # bounded by its set-up timeout
        return await asyncio.wait_for(engine.ascore_top_batch(sequences, starts, self.top_k),
                                      self.timeout)

    def close(self) -> None:
        with self._lock:
            engine, self._engine, self._connecting = self._engine, None, None
        if engine is not None:
            engine.destroy()


class DistillWorkflow(RLVRWorkflow):
    """One prompt in, `gconfig.n_samples` rows with the teacher's log-probs out (see the
    module doc). `teacher` may be None only where no episode runs (other trainer ranks)."""

    def __init__(self, reward_fn: Callable[..., Any], gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, teacher: Optional[TeacherScorer],
                 use_task_reward: bool = True,
                 reward_executor: Optional[RewardExecutor] = None) -> None:
        super().__init__(reward_fn, gconfig, tokenizer, reward_executor)
        self.teacher, self.use_task_reward = teacher, use_task_reward

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        input_ids = self.prompt_ids(data)
        prompt = decode_text(self.tokenizer, input_ids)
        responses = await self.sample_group(engine, input_ids)
        teacher = await self.teacher_logprobs(responses)
        rewards: list[float | RewardFailure] = [0.0] * len(responses)
        if self.use_task_reward:
            rewards = await self.score(prompt, responses, data)
        for resp, scored in zip(responses, teacher, strict=True):
            if isinstance(scored, TokenScores) and scored.logprobs:
                kl = sum(s - t for t, s in zip(scored.logprobs, resp.output_logprobs,
                                               strict=True))
                stats_tracker.scalar(**{"distill/reverse_kl": kl / len(scored.logprobs)})
        # a sample is scored when both its task reward and its teacher log-probs are
        merged = [t if isinstance(t, RewardFailure) else r for r, t in zip(rewards, teacher,
                                                                          strict=True)]
        extra = self._teacher_columns(len(input_ids), teacher)
        return self.group_trajectory(input_ids, responses, merged,
                                     stable_id(data.get("id", prompt)), **extra)

    def _teacher_columns(self, n_prompt: int, teacher: list[TokenScores | RewardFailure]
                         ) -> dict[str, list[Optional[torch.Tensor]]]:
        """Per row, the teacher's tensors (prompt positions 0; None for a failed row)."""
        k = self.teacher.top_k if self.teacher is not None else 0
        columns: dict[str, list[Optional[torch.Tensor]]] = {"teacher_logprobs": []}
        if k:
            columns.update(teacher_top_ids=[], teacher_top_logprobs=[])
        for scored in teacher:
            if isinstance(scored, RewardFailure):
                for rows in columns.values():
                    rows.append(None)
                continue
            columns["teacher_logprobs"].append(
                torch.tensor([0.0] * n_prompt + scored.logprobs, dtype=torch.float32))
            if k:
                ids = torch.zeros(1, n_prompt + len(scored.top_ids), k, dtype=torch.long)
                lps = torch.zeros(1, n_prompt + len(scored.top_ids), k, dtype=torch.float32)
                if scored.top_ids:
                    ids[0, n_prompt:] = torch.tensor(scored.top_ids, dtype=torch.long)
                    lps[0, n_prompt:] = torch.tensor(scored.top_logprobs, dtype=torch.float32)
                columns["teacher_top_ids"].append(ids)
                columns["teacher_top_logprobs"].append(lps)
        return columns

    async def teacher_logprobs(self, responses: list[ModelResponse]
                               ) -> list[TokenScores | RewardFailure]:
        """The teacher's log-probs of each completion's tokens (the group in one request); if
        that fails, every sample's `RewardFailure`, each counted (a spent budget raises)."""
        if self.teacher is None:
            raise RuntimeError("DistillWorkflow was built without a teacher (teacher=None); "
                               "pass a TeacherScorer where episodes run")
        executor = self.reward_executor
        scored = [r for r in responses if r.output_len]  # an empty completion has nothing
        try:
            got = await self.teacher.score([r.input_tokens + r.output_tokens for r in scored],
                                           [len(r.input_tokens) for r in scored]
                                           ) if scored else []
            for lp, resp in zip(got, scored, strict=True):
                if len(lp.logprobs) != resp.output_len:
                    raise ValueError(f"{len(lp.logprobs)} log-probs for {resp.output_len} tokens")
                if self.teacher.top_k and len(lp.top_ids) != resp.output_len:
                    raise ValueError(f"top-{self.teacher.top_k} tokens at {len(lp.top_ids)} "
                                     f"positions for {resp.output_len} tokens")
            by_id = {id(r): lp for r, lp in zip(scored, got, strict=True)}
            lps = [by_id.get(id(r), TokenScores([])) for r in responses]
        except (asyncio.TimeoutError, TimeoutError):
            failure = RewardFailure(TEACHER, "timeout", f"no log-probs from "
                                    f"{self.teacher.where} within {self.teacher.timeout} s "
                                    f"(teacher.request_timeout)")
        except Exception as e:  # noqa: BLE001 - any teacher error fails these samples only
            failure = RewardFailure(TEACHER, "raised", f"{type(e).__name__}: {e}")
        else:
            for _ in responses:
                executor.record(TEACHER, None)
            return list(lps)
        for _ in responses:
            executor.record(TEACHER, failure)  # raises RewardBudgetExceeded past the budget
        return [failure] * len(responses)
