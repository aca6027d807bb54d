"""Step-labelled worked counts on the shapes pictures, and a CLI that builds a vision PRM.

    python -m areal_like.data.prm_shapes --init-from runs/sft_count/trial0/final \
        --out .cache/models/shapes-prm --steps 400

Each example is a count item's chat prompt with its picture and a worked answer cut into
steps at "; " (`shapes.worked_count`: the colour of every shape in reading order, then
"#### <count>").
Labels come from the picture (`shapes.count_step_labels`, Math-Shepherd: 1 while every step
so far is right). Besides the right answer, an example may have one changed step (another
colour, a shape left out or made up, a wrong count: what a policy gets wrong), or be
`malformed`: the worked text cut at random places, all label 0 (against a policy that cuts
its text into many short "steps" the PRM likes). With `--policy`, worked answers sampled from
that model are added, labelled the same way (Math-Shepherd's data: the mistakes a policy
really makes, which the made-up ones miss; docs/vision.md). Items come from the train split;
the held-out check uses test pictures.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from areal_like.data.shapes import (
    COLOURS,
    SHAPES,
    STEP_DELIMITER,
    count_step_labels,
    load_shapes,
    worked_count,
)
from areal_like.models.vision import VisionProcessor
from areal_like.rewards.prm_steps import split_steps
from areal_like.rewards.vision_prm import (
    VisionPRM,
    VisionPRMExample,
    build_vision_prm,
    step_accuracy,
    train_vision_prm,
)
from areal_like.utils.chat import decode_text

Shapes = list[tuple[str, str]]


def _changed(shapes: Shapes, answer: str, rng: random.Random) -> tuple[Shapes, str]:
    """The shapes and count of a worked answer with one mistake in it."""
    shapes = list(shapes)
    kind = rng.choice(["colour", "drop", "extra", "count"])
    k = rng.randrange(len(shapes))
    if kind == "colour":
        shapes[k] = (rng.choice([c for c in COLOURS if c != shapes[k][0]]), shapes[k][1])
    elif kind == "drop" and len(shapes) > 1:
        del shapes[k]
    elif kind == "extra" and len(shapes) < 4:
        shapes.insert(k, (rng.choice(list(COLOURS)), rng.choice(SHAPES)))
    else:
        return shapes, str(rng.choice([n for n in range(5) if str(n) != answer]))
    return shapes, answer


def _malformed(text: str, rng: random.Random) -> list[str]:
    """`text` cut at 1-4 random places that are not step boundaries."""
    inner = [i for i in range(1, len(text)) if not text[:i].endswith(STEP_DELIMITER)]
    cuts = sorted(rng.sample(inner, rng.randint(1, 4)))
    pieces = [text[a:b].strip() for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [p + STEP_DELIMITER for p in pieces[:-1] if p] + [pieces[-1] or "#"]


def prm_examples(processor: VisionProcessor, n: int, split: str = "train", seed: int = 1,
                 malformed: float = 0.2) -> list[VisionPRMExample]:
    """`n` labelled examples: a `malformed` share, half of the others with one mistake."""
    rng = random.Random(f"prm-shapes-{split}-{seed}")
    out = []
    for item in load_shapes(n, split, seed, question="count"):
        prompt = str(processor.tokenizer.apply_chat_template(
            item["messages"], tokenize=False, add_generation_prompt=True))
        truth = [(c, k) for c, k in item["shapes"]]
        if rng.random() < malformed:
            steps = _malformed(worked_count(truth, item["answer"]), rng)
            labels = [0] * len(steps)
        else:
            shapes, answer = ((truth, item["answer"]) if rng.random() < 0.5
                              else _changed(truth, item["answer"], rng))
            steps = split_steps(worked_count(shapes, answer), STEP_DELIMITER)
            labels = count_step_labels(steps, truth, item["answer"])
        out.append(VisionPRMExample(prompt, item["images"], steps, labels))
    return out


@torch.no_grad()
def policy_examples(policy: str, n: int, split: str = "train", seed: int = 1,
                    max_new_tokens: int = 48) -> list[VisionPRMExample]:
    """One worked answer sampled (temperature 1) from the VLM folder `policy` for each of
    `n` count items, cut into steps and labelled from the picture."""
    from transformers import AutoModelForImageTextToText

    processor = VisionProcessor(policy)
    model = AutoModelForImageTextToText.from_pretrained(policy).eval()
    eos = processor.tokenizer.eos_token_id
    torch.manual_seed(seed)
    out = []
    for item in load_shapes(n, split, seed + 7, question="count"):  # other pictures
        prompt = processor.prompt(item["messages"], item["images"])
        ids = torch.tensor([prompt.expanded_ids])
        sampled = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == processor.image_token_id).long(),
            pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
            max_new_tokens=max_new_tokens, do_sample=True, eos_token_id=eos, pad_token_id=eos)
        text = decode_text(processor.tokenizer, sampled[0, ids.shape[1]:].tolist(),
                           skip_special_tokens=True)
        steps = split_steps(text, STEP_DELIMITER)
        if steps:
            labels = count_step_labels(steps, [(c, k) for c, k in item["shapes"]],
                                       item["answer"])
            out.append(VisionPRMExample(decode_text(processor.tokenizer, prompt.input_ids),
                                        item["images"], steps, labels))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init-from", required=True,
                        help="VLM folder that starts the PRM (e.g. the policy's SFT warm start)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=400, help="training batches")
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", default=None,
                        help="VLM folder whose sampled worked answers join the training data")
    parser.add_argument("--policy-samples", type=int, default=1000)
    parser.add_argument("--train-vision-tower", action="store_true",
                        help="train the vision tower too (default: frozen)")
    args = parser.parse_args(argv)
    out = build_vision_prm(args.out, args.init_from, args.seed)
    processor = VisionProcessor(out)
    start = time.perf_counter()
    examples = prm_examples(processor, args.examples, seed=args.seed)
    if args.policy:
        examples += policy_examples(args.policy, args.policy_samples, seed=args.seed)
    stats = train_vision_prm(out, examples,
                             args.steps, seed=args.seed,
                             freeze_vision_tower=not args.train_vision_tower)
    held_out = step_accuracy(VisionPRM(out).eval(),
                             prm_examples(processor, 300, "test", args.seed))
    print(f"vision PRM {out}: {stats['steps']:.0f} steps in {time.perf_counter() - start:.0f} s,"
          f" last loss {stats['loss']:.3f}; held-out step accuracy {held_out['accuracy']:.3f} "
          f"(label 0: {held_out['label0']:.3f}, label 1: {held_out['label1']:.3f}, "
          f"{held_out['steps']} steps)")
    if args.policy:
        sampled = step_accuracy(VisionPRM(out).eval(),
                                policy_examples(args.policy, 200, "test", args.seed + 1))
        print(f"  on the policy's own held-out samples: step accuracy {sampled['accuracy']:.3f}"
              f" (label 0: {sampled['label0']:.3f}, label 1: {sampled['label1']:.3f}, "
              f"{sampled['steps']} steps)")


if __name__ == "__main__":
    main()
