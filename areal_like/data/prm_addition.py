"""Step-labelled worked additions for a process reward model, and a CLI that builds one.

    python -m areal_like.data.prm_addition --out .cache/models/addition-prm --seconds 120 \
        [--init-from .cache/models/addition-sft-worked]

Each example is a chat prompt ("What is a + b?") and the worked answer of
`addition.worked_addition` cut into steps at "; " (one step per column, the last one ending
with "#### <sum>"). A `malformed` share is the worked text cut at random places into 2-6
"steps" (label 0 throughout: a policy trained against summed or averaged scores otherwise
learns to cut junk into many short steps the PRM never saw); half of the rest have one
corrupted step (a wrong column total, or a wrong final sum). Labels follow Math-Shepherd:
1 while every step so far is correct, 0 from the first wrong step on.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

from transformers import AutoModelForTokenClassification, AutoTokenizer

from areal_like.data.addition import addition_question, worked_addition
from areal_like.rewards.prm_model import PRMExample, build_prm, step_scores, train_prm
from areal_like.rewards.prm_steps import split_steps
from areal_like.utils.chat import render_chat

STEP_DELIMITER = "; "
_TOTAL = re.compile(r"= (\d+), write (\d+)")
_SUM = re.compile(r"#### (\d+)$")


def _corrupt(step: str, rng: random.Random) -> str:
    """`step` with a wrong column total (and matching written digit) or a wrong final sum."""
    final, column = _SUM.search(step), _TOTAL.search(step)
    if final and (rng.random() < 0.5 or not column):
        s = int(final.group(1))
        return _SUM.sub(f"#### {max(0, s + rng.choice([-10, -2, -1, 1, 2, 10]))}", step)
    assert column is not None, f"step {step!r} has neither a column total nor a final sum"
    total = int(column.group(1))
    wrong = max(0, total + rng.choice([-2, -1, 1, 2])) if total > 0 else total + 1
    written = column.group(2)
    new_written = str(wrong % 10) if len(written) == 1 and total >= 10 else str(wrong)
    return _TOTAL.sub(f"= {wrong}, write {new_written}", step, count=1)


def _malformed(text: str, rng: random.Random) -> list[str]:
    """`text` cut at 1-5 random places that are not step boundaries, each piece + "; "."""
    inner = [i for i in range(1, len(text)) if not text[:i].endswith(STEP_DELIMITER)]
    cuts = sorted(rng.sample(inner, rng.randint(1, 5)))
    pieces = [text[a:b].strip() for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [p + STEP_DELIMITER for p in pieces[:-1] if p] + [pieces[-1] or "#"]


def prm_examples(tokenizer, n: int, num_digits: int = 2, seed: int = 1,
                 malformed: float = 0.25) -> list[PRMExample]:
    """`n` (chat prompt, steps, labels) examples: a `malformed` share cut at random places,
    half of the others with one corrupted step."""
    rng = random.Random(f"prm-addition-{num_digits}-{seed}")
    lo, hi = (0 if num_digits == 1 else 10 ** (num_digits - 1)), 10**num_digits - 1
    out: list[PRMExample] = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        prompt = render_chat(tokenizer, [{"role": "user", "content": addition_question(a, b)}])
        steps = split_steps(worked_addition(a, b), STEP_DELIMITER)
        labels = [1] * len(steps)
        if rng.random() < malformed:
            steps = _malformed(worked_addition(a, b), rng)
            labels = [0] * len(steps)
        elif rng.random() < 0.5:
            k = rng.randrange(len(steps))
            steps[k] = _corrupt(steps[k], rng)
            labels[k:] = [0] * (len(steps) - k)
        out.append((prompt, steps, labels))
    return out


def step_accuracy(model_dir: str | Path, examples: list[PRMExample]) -> float:
    """Share of steps whose score is on the side of 0.5 its label says."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForTokenClassification.from_pretrained(model_dir).eval()
    right = total = 0
    for prompt, steps, labels in examples:
        for score, label in zip(step_scores(model, tokenizer, prompt, steps), labels,
                                strict=True):
            right += int((score > 0.5) == bool(label))
            total += 1
    return right / total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", default="1m")
    parser.add_argument("--seconds", type=float, default=120.0, help="training time budget")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--init-from", default=None,
                        help="causal LM folder whose backbone starts the PRM (e.g. the SFT "
                        "warm start); default: random weights")
    args = parser.parse_args(argv)
    out = build_prm(args.out, args.size, args.seed, init_from=args.init_from)
    tokenizer = AutoTokenizer.from_pretrained(out)
    start = time.perf_counter()
    stats = train_prm(out, prm_examples(tokenizer, 20000, seed=args.seed), args.seconds,
                      seed=args.seed)
    acc = step_accuracy(out, prm_examples(tokenizer, 300, seed=args.seed + 1000))
    print(f"PRM {out}: {stats['steps']:.0f} steps in {time.perf_counter() - start:.0f} s, "
          f"last loss {stats['loss']:.3f}, held-out step accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
