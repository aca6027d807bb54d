"""The REINFORCE loss and the two-class actor of AReaL-lite's "Training Algorithm" document
(Step 2), ported: only the imports differ, and the lines marked `# areal-like:`."""

import torch
from tensordict import TensorDict

from areal_like.arealite import FSDPEngine, TrainEngine, gather_logprobs


def reinforce_loss_fn(logits, data):
    input_ids = data["input_ids"]
    loss_mask = data["loss_mask"].bool()
    rewards = data["rewards"]
    logprobs = gather_logprobs(
        logits, torch.roll(input_ids, shifts=-1, dims=-1)
    )
    loss = -logprobs * rewards
    loss = torch.where(loss_mask, loss, 0.0)
    return loss.sum() / loss_mask.count_nonzero()


class ReinforceActor:
    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def train_reinforce(self, data: TensorDict):
        # Enable gradient checkpointing
        self.engine.train()
        return self.engine.train_batch(
            data,
            loss_fn=reinforce_loss_fn,
            loss_weight_fn=lambda x: x["loss_mask"].count_nonzero(),
        )


class FSDPReinforceActor(FSDPEngine):
    def __init__(self, config):  # areal-like: the document's __init__(self) drops the config it is called with, FSDPReinforceActor(config=...)
        super().__init__(config)  # areal-like: and so never builds the engine
        self.actor = ReinforceActor(self)

    def train_reinforce(self, *args, **kwargs):
        return self.actor.train_reinforce(*args, **kwargs)
