"""Multi-turn: on a wrong answer, append feedback and let the model try again."""

from __future__ import annotations

from typing import Any, Callable, Optional

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import (
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    RolloutWorkflow,
    validate_trajectory,
)
from areal_like.rewards.reward_executor import RewardExecutor, UsesRewards
from areal_like.utils.chat import decode_text, render_chat
from workflows.common import (
    TrajectoryBuilder,
    chat_prompt_ids,
    load_tokenizer,
    stable_id,
    with_eos_stop,
)

DEFAULT_FEEDBACK = "Your answer is wrong. Please try again."


class MultiTurnWorkflow(RolloutWorkflow, UsesRewards):
    """Up to `max_turns` attempts in one conversation; reward = r × turn_discount^(turns-1).

    Token-in/token-out: each turn sends the exact ids accumulated so far (prompt, earlier
    generations as generated, feedback ids), so earlier turns are never re-tokenized and the
    trajectory equals the concatenation of what was sent and generated. All turns share one
    `rid` prefix so the server's prefix cache is reused. Only generated tokens are trained on.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        gconfig: GenerationHyperparameters,
        tokenizer: PreTrainedTokenizerBase | str,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        feedback: str = DEFAULT_FEEDBACK,
        reward_executor: Optional[RewardExecutor] = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"MultiTurnWorkflow.max_turns={max_turns}; expected >= 1")
        self.reward_fn = reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        self.gconfig = with_eos_stop(gconfig.new(n_samples=1), self.tokenizer)
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.use_rewards(reward_fn, reward_executor)  # else the episode's (see UsesRewards)
        self.feedback_ids = self._feedback_ids(feedback)

    def _feedback_ids(self, feedback: str) -> list[int]:
        # The assistant turn ends with EOS (<|im_end|>); ChatML then puts a newline before the
        # next turn's header. Only this suffix is tokenized, never the history.
        turn = render_chat(self.tokenizer, [{"role": "user", "content": feedback}])
        return self.tokenizer.encode("\n" + turn, add_special_tokens=False)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        prompt_ids = chat_prompt_ids(self.tokenizer, data["messages"])
        prompt = decode_text(self.tokenizer, prompt_ids)
        builder = TrajectoryBuilder(prompt_ids)
        rid = f"multiturn-{stable_id(data.get('id', prompt))}-{id(builder)}"
        reward, turn = 0.0, 0
        for turn in range(self.max_turns):
            sent = list(builder.input_ids)
            resp = await engine.agenerate(
                ModelRequest(input_ids=sent, gconfig=self.gconfig, rid=f"{rid}-{turn}",
                             metadata={"session": rid})
            )
            builder.add_generation(resp)
            completion = decode_text(self.tokenizer, resp.output_tokens, skip_special_tokens=True)
            reward = await self.reward_executor(self.reward_fn, prompt, completion, **data,
                                                token_ids=(resp.input_tokens, resp.output_tokens))
            if reward > 0 or turn == self.max_turns - 1:
                break
            if not resp.output_tokens or resp.output_tokens[-1] != self.tokenizer.eos_token_id:
                builder.add_context([self.tokenizer.eos_token_id])  # close a truncated turn
            builder.add_context(self.feedback_ids)
        final = reward * self.turn_discount**turn
        td = builder.to_tensordict(final, raw_rewards=reward, num_turns=turn + 1,
                                   group_id=stable_id(data.get("id", prompt)))
        return validate_trajectory(td)
