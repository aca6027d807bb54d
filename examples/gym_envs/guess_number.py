"""Guess the number: a Gymnasium text environment, as a user writes one for any framework.

The secret is drawn from the reset seed (or given as `options["secret"]`); each action is a
guess, answered "higher", "lower" or "correct"; a reply with no number is told so. Reward 1.0
for the right guess, 0 otherwise; truncated after `max_guesses`.

    gymnasium.make("examples.gym_envs.guess_number:GuessNumber-v0")
"""

from __future__ import annotations

import re
from typing import Any, Optional

import gymnasium
from gymnasium import spaces

NUMBER = re.compile(r"-?\d+")


class GuessNumber(gymnasium.Env):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, low: int = 1, high: int = 20, max_guesses: int = 4) -> None:
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.observation_space = spaces.Text(max_length=200)
        self.action_space = spaces.Text(max_length=2000)
        self.secret, self.guesses = low, 0

    def reset(self, *, seed: Optional[int] = None,
              options: Optional[dict[str, Any]] = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        given = (options or {}).get("secret")
        self.secret = int(given) if given is not None else int(
            self.np_random.integers(self.low, self.high + 1))
        self.guesses = 0
        return (f"I am thinking of a number from {self.low} to {self.high}. Guess it: reply "
                f"with one number.", {"secret": self.secret})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.guesses += 1
        truncated = self.guesses >= self.max_guesses
        found = NUMBER.search(action)
        if found is None:
            return "That is not a number. Reply with one number.", 0.0, False, truncated, {}
        guess = int(found.group())
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {}
        hint = "higher" if guess < self.secret else "lower"
        return f"No: the number is {hint} than {guess}.", 0.0, False, truncated, {}


gymnasium.register("GuessNumber-v0", entry_point=f"{__name__}:GuessNumber")
