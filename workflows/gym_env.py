"""Gymnasium-style text environments as multi-turn episodes, unchanged.

An environment is anything with Gymnasium's API and text in both directions:
`reset(seed=, options=) -> (observation, info)` and
`step(action) -> (observation, reward, terminated, truncated, info)`, the observations and
actions strings (`gymnasium.spaces.Text`). Each observation is a user turn, the policy's
reply is the action; the episode ends when the environment says so (terminated or truncated)
or after `max_turns` replies. Every reply is recorded token-in/token-out (`ArealOpenAI`: a
turn's prompt is the previous turn's exact ids plus the new text), every step's reward is
the environment's own.

    workflow = GymTextWorkflow("examples.gym_envs.guess_number:GuessNumber-v0", gconfig,
                               tokenizer, max_turns=4)

The environment comes from `gymnasium.make(env_id, **env_kwargs)` (an id `module:Name-v0`
imports `module` first, which registers it), or from a callable `env_factory(data)`. The data
item is passed to `reset` as `options`; the reset seed is drawn from the episode's seed, so
a resumed run replays the same environments. An environment that raises fails the episode
(the executor excludes and counts it), never a reward of 0.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any, Callable, Optional, Protocol, SupportsFloat

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, RolloutWorkflow
from areal_like.api.seeding import current_episode, derive_seed, random_seed
from areal_like.utils.batching import concat_padded
from workflows.common import load_tokenizer, stable_id
from workflows.openai_client import ArealOpenAI


class TextEnv(Protocol):
    """The part of `gymnasium.Env` an episode uses."""

    def reset(self, *, seed: Optional[int] = None,
              options: Optional[dict[str, Any]] = None) -> tuple[Any, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]: ...

    def close(self) -> None: ...


class EnvError(RuntimeError):
    """The environment broke its contract (an observation that is not text, a bad reward)."""


def _text(observation: Any, env_name: str, when: str) -> str:
    if not isinstance(observation, str):
        raise EnvError(f"environment {env_name}: its {when} observation is "
                       f"{type(observation).__name__}, not text (gymnasium.spaces.Text)")
    return observation


class GymTextWorkflow(RolloutWorkflow):
    """`gconfig.n_samples` episodes of a text environment per data item, concurrently (one
    environment and one recording client each); a group of rows with one `group_id`.

    Rewards: `export_style` "concat" trains one row per conversation with the episode's
    return `sum_t turn_discount**t * r_t`; "individual" one row per reply, each with its
    returns-to-go. `system_prompt`, when given, opens every conversation."""

    def __init__(self, env: str | Callable[[dict[str, Any]], TextEnv],
                 gconfig: GenerationHyperparameters, tokenizer: PreTrainedTokenizerBase | str,
                 max_turns: int = 8, turn_discount: float = 1.0, export_style: str = "concat",
                 env_kwargs: Optional[dict[str, Any]] = None,
                 system_prompt: Optional[str] = None) -> None:
        if export_style not in ("concat", "individual"):
            raise ValueError(f"export_style={export_style!r}: expected 'concat' or "
                             f"'individual'")
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r}: expected at least 1")
        if not 0.0 <= turn_discount <= 1.0:
            raise ValueError(f"turn_discount={turn_discount!r}: expected a value in [0, 1]")
        if isinstance(env, str):
            self.env_name = env
            self._make = self._gym_maker(env, dict(env_kwargs or {}))
        else:
            self.env_name = getattr(env, "__qualname__", repr(env))
            self._make = env
        self.gconfig = gconfig
        self.tokenizer = load_tokenizer(tokenizer)
        self.max_turns, self.turn_discount = max_turns, turn_discount
        self.export_style, self.system_prompt = export_style, system_prompt

    @staticmethod
    def _gym_maker(env_id: str, env_kwargs: dict[str, Any]
                   ) -> Callable[[dict[str, Any]], TextEnv]:
        try:
            import gymnasium
        except ImportError as e:
            raise ImportError(f"GymTextWorkflow({env_id!r}) needs gymnasium: pip install "
                              f"'areal-like[envs]'") from e
        # a wrong id fails here, at construction, not in every episode
        module, _, name = env_id.rpartition(":")  # `module:Name-v0` registers on import
        try:
            if module:
                importlib.import_module(module)
            gymnasium.spec(name)
        except (ImportError, gymnasium.error.Error) as e:
            raise ValueError(f"GymTextWorkflow: no gymnasium environment {env_id!r} "
                             f"({type(e).__name__}: {e})") from None
        # gymnasium's own checker wants numpy observations; text ones fail it
        return lambda data: gymnasium.make(env_id, disable_env_checker=True, **env_kwargs)

    async def _episode(self, engine: InferenceEngine, data: dict[str, Any], group_id: int,
                       sample: int) -> TensorDict:
        episode = current_episode()
        seed = derive_seed(episode.seed, "env", sample) if episode else random_seed()
        env = self._make(data)
        try:
            client = await self._play(env, engine, data, seed)
        finally:
            env.close()
        return client.export_batch(self.export_style, group_id=group_id)

    async def _play(self, env: TextEnv, engine: InferenceEngine, data: dict[str, Any],
                    seed: int) -> ArealOpenAI:
        client = ArealOpenAI(engine, self.tokenizer, self.gconfig.new(n_samples=1))
        observation, _ = env.reset(seed=seed, options=data)
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        messages.append({"role": "user", "content": _text(observation, self.env_name, "first")})
        rewards: list[float] = []
        for turn in range(self.max_turns):
            completion = await client.chat.completions.create(model="policy",
                                                              messages=messages)
            action = completion.choices[0].message.content or ""
            observation, reward, terminated, truncated, _ = env.step(action)
            try:
                rewards.append(float(reward))
            except (TypeError, ValueError):
                raise EnvError(f"environment {self.env_name}: step {turn} gave reward "
                               f"{reward!r}, not a number") from None
            client.set_reward(completion.id, rewards[-1])
            if terminated or truncated:
                break
            messages += [{"role": "assistant", "content": action},
                         {"role": "user", "content": _text(observation, self.env_name,
                                                           f"step {turn}")}]
        if self.export_style == "concat":
            episode_return = sum(r * self.turn_discount ** t for t, r in enumerate(rewards))
            for rec in client.completions:  # each chain's row (one, unless re-rendered)
                rec.reward = episode_return
        else:
            client.apply_reward_discount(self.turn_discount)
        return client

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        group_id = stable_id(data.get("id", repr(sorted(data.items()))))
        rows = await asyncio.gather(*[self._episode(engine, data, group_id, i)
                                      for i in range(self.gconfig.n_samples)])
        return concat_padded(list(rows))
