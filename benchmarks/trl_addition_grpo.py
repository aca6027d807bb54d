"""TRL's `GRPOTrainer` on the main job's task: the other side of `benchmarks/vs_trl.py`.

Runs in TRL's own environment (`scripts/install_trl.sh`, `.venv-trl`), never in the project's:

    .venv-trl/bin/python benchmarks/trl_addition_grpo.py --model DIR --out FILE.jsonl \
        [--seed 1] [--steps 200] [--eval-every 25] [--lr 1.5e-4] [--worked-fraction 0]

The same items as the main job (`areal_like.data.addition`, imported from this repository:
plain Python), the same verifier (`exact_match_reward`), the same SFT warm start, prompts per
step, group size, answer length, temperature, learning-rate schedule and held-out set.
Held-out greedy accuracy is measured at step 0 and every `--eval-every` steps inside the
training loop (TRL has no evaluation beside training); its time is recorded so the driver can
leave it out of the loop's time. Writes one JSON line per event to `--out`: `start` (after the
imports), `ready` (trainer built), `step` (wall clock, and the step's generation / reward /
train seconds), `eval`, `end`.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

LAUNCHED = time.time()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from areal_like.data.addition import make_addition_items  # noqa: E402
from areal_like.rewards.exact_match import exact_match_reward  # noqa: E402


class Events:
    """The JSONL the driver reads; every line has the wall clock (`unix`)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w")  # noqa: SIM115 (open for the whole run)

    def write(self, kind: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": kind, "unix": time.time(), **fields}) + "\n")
        self.file.flush()


def reward_fn(prompts: list, completions: list, answer: list[str], **_: Any) -> list[float]:
    """TRL's reward signature over the project's verifier (chat completions: the text)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [exact_match_reward("", text, a) for text, a in zip(texts, answer, strict=True)]


@torch.no_grad()
def held_out_accuracy(model: Any, tokenizer: Any, items: list[dict], max_new_tokens: int,
                      batch_size: int = 200) -> float:
    """Greedy answers to the held-out prompts (chat template, left padding), exact match."""
    was_training = model.training
    model.eval()
    correct = 0
    tokenizer.padding_side = "left"
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(i["messages"], tokenize=False,
                                                 add_generation_prompt=True) for i in batch]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                       skip_special_tokens=True)
        correct += sum(exact_match_reward("", t, i["answer"]) for t, i in zip(texts, batch,
                                                                              strict=True))
    model.train(was_training)
    return correct / len(items)


class Timed:
    """Seconds spent in some of the trainer's methods during the current step."""

    def __init__(self, trainer: Any, names: dict[str, str]) -> None:
        self.spent = dict.fromkeys(names.values(), 0.0)
        for method, label in names.items():
            setattr(trainer, method, self._wrap(getattr(trainer, method), label))

    def _wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[label] += time.perf_counter() - began
        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, dict.fromkeys(self.spent, 0.0)
        return {k: round(v, 4) for k, v in spent.items()}


class Progress(TrainerCallback):
    """Step times, their breakdown and held-out accuracy every `every` steps."""

    def __init__(self, events: Events, model: Any, tokenizer: Any, held_out: list[dict],
                 every: int, max_new_tokens: int) -> None:
        self.events, self.model, self.tokenizer = events, model, tokenizer
        self.held_out, self.every, self.max_new_tokens = held_out, every, max_new_tokens
        self.timed: Timed | None = None

    def evaluate(self, step: int) -> None:
        began = time.time()
        accuracy = held_out_accuracy(self.model, self.tokenizer, self.held_out,
                                     self.max_new_tokens)
        self.events.write("eval", step=step, accuracy=accuracy, eval_s=time.time() - began)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.evaluate(0)
        self.events.write("train_begin")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        spent = self.timed.take() if self.timed else {}
        self.events.write("step", step=state.global_step, **spent)
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.evaluate(state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1.5e-4)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--worked-fraction", type=float, default=0.0)
    # 0: torch's default (every core this process may use), as TRL's users run it
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    events = Events(args.out)
    events.write("launched", unix_launch=LAUNCHED, threads=torch.get_num_threads())
    set_seed(args.seed)
    # the main job's items: train 6000 (seed 1), held-out the first 200 of the test split
    train = make_addition_items(2, 6000, "train", 1, args.worked_fraction)
    held_out = make_addition_items(2, 200, "test", 1, args.worked_fraction)
    dataset = Dataset.from_list([{"prompt": i["messages"], "answer": i["answer"]}
                                 for i in train])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    completions = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=str(args.out.parent / f"trl_out_{args.seed}"), seed=args.seed,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        per_device_train_batch_size=completions, gradient_accumulation_steps=1,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="grpo",
        scale_rewards="group", num_iterations=1, use_cpu=True, bf16=False, fp16=False,
        logging_steps=args.steps, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=False)  # ours recomputes nothing
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=config,
                          train_dataset=dataset, processing_class=tokenizer)
    progress = Progress(events, trainer.model, tokenizer, held_out, args.eval_every,
                        args.max_new_tokens)
    progress.timed = Timed(trainer, {"_generate": "generate_s", "_calculate_rewards": "reward_s",
                                     "_prepare_inputs": "prepare_s",
                                     "training_step": "step_total_s"})
    trainer.add_callback(progress)
    events.write("ready")
    trainer.train()
    events.write("end")


if __name__ == "__main__":
    main()
