"""The calculator task: multiplications a 1M-parameter model cannot do in its head, but can
do with a Python tool: copy the numbers into a call, then copy the tool's output.

    train_dataset.type: examples.calculator_agent.task:make_task         # RL: the questions
    train_dataset.type: examples.calculator_agent.task:make_demos        # SFT warm start

The warm start's demonstrations call the tool for only `tool_share` of the questions and
answer the others straight away with a guess (always wrong): the warm-started agent calls the
tool about that often, and RL has to teach it to call it every time. Every (a, b) pair belongs
to one split by a hash, so held-out questions are never trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from typing import Any

TEST_FRACTION = 10  # one pair in TEST_FRACTION is held out
NUMBER = re.compile(r"-?\d+")


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def tool_call_text(a: int, b: int) -> str:
    """The reply that calls the tool, as the model writes it (the gateway parses it). The
    code comes first: a 1M model copies the numbers better from fewer tokens back."""
    call = {"arguments": {"code": f"print({a} * {b})"}, "name": "python"}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def _split_of(a: int, b: int) -> str:
    digest = hashlib.blake2b(f"calc{a}*{b}".encode(), digest_size=4).digest()
    return "test" if int.from_bytes(digest, "little") % TEST_FRACTION == 0 else "train"


def _pairs(split: str, size: int, seed: int, digits: tuple[int, int]) -> list[tuple[int, int]]:
    if split not in ("train", "test"):
        raise ValueError(f"calculator task: split={split!r}; expected 'train' or 'test'")
    rng = random.Random(f"{seed}-{split}")
    lows = [10 ** (d - 1) for d in digits]
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < size:
        pair = (rng.randrange(lows[0], lows[0] * 10), rng.randrange(lows[1], lows[1] * 10))
        if pair not in seen and _split_of(*pair) == split:
            seen.add(pair)
            pairs.append(pair)
    return pairs


def make_task(split: str, size: int, seed: int, digits: tuple[int, int] = (3, 2)
              ) -> list[dict[str, Any]]:
    """The questions: `answer` is the product (the verifier reads the agent's answer file)."""
    return [{"id": f"{split}-{i}", "question": question(a, b), "answer": str(a * b),
             "messages": [{"role": "user", "content": question(a, b)}]}
            for i, (a, b) in enumerate(_pairs(split, size, seed, tuple(digits)))]  # type: ignore[arg-type]


def make_demos(split: str, size: int, seed: int, digits: tuple[int, int] = (3, 2),
               tool_share: float = 0.5) -> list[dict[str, Any]]:
    """SFT rows (`messages` -> `target`): a first turn that calls the tool (then a second
    turn that answers with the tool's output) for `tool_share` of the questions, a first turn
    that guesses for the others."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"calculator demos: tool_share={tool_share}; expected 0..1")
    rng = random.Random(f"{seed}-{split}-demos")
    rows: list[dict[str, Any]] = []
    for a, b in _pairs(split, size, seed, tuple(digits)):  # type: ignore[arg-type]
        asked = [{"role": "user", "content": question(a, b)}]
        if rng.random() < tool_share:
            call = tool_call_text(a, b)
            rows.append({"messages": asked, "target": call, "answer": call})
            answered = [*asked, {"role": "assistant", "content": call},
                        {"role": "tool", "content": f"{a * b}\n"}]
            rows.append({"messages": answered, "target": str(a * b), "answer": str(a * b)})
        else:
            guess = str(a * b + rng.choice([-1, 1]) * rng.randrange(1, 10 ** len(str(a))))
            rows.append({"messages": asked, "target": guess, "answer": guess})
        if len(rows) >= size:
            break
    return rows[:size]


def score(item: dict[str, Any], run: Any) -> float:
    """The program's verifier: 1.0 when the answer it wrote is the product."""
    found = NUMBER.findall(run.read("answer.txt"))  # empty when it gave no answer
    return 1.0 if found and found[-1] == item["answer"] else 0.0
