"""The `actor.parallel` (and `critic.parallel`) section: how a trainer's ranks are laid out on
one device mesh of data x sequence x tensor dimensions (engines/fsdp/mesh.py builds it).

Ranks are numbered data-outermost, tensor-innermost: rank = (d * sp + s) * tp + t. The ranks
of one sequence-parallel (or tensor-parallel) group hold the same rows of a batch; the data
dimension is the rest of the world, and FSDP2 shards the weights over data x sequence."""

from __future__ import annotations

from dataclasses import dataclass

from areal_like.api.config_checks import at_least, bounded, check_bounds


@dataclass
class ParallelConfig:
    """Sequence (Ulysses) and tensor parallelism of the trainer; data parallelism is the rest."""

    # Ulysses: each packed micro-batch's tokens split over this many ranks, attention heads
    # exchanged by all-to-all (engines/fsdp/ulysses.py); must divide the attention head count
    sequence_parallel_size: int = bounded(1, bound=at_least(1))
    # attention and MLP projections split column/row-wise over this many ranks (DTensor)
    tensor_parallel_size: int = bounded(1, bound=at_least(1))

    def __post_init__(self) -> None:
        check_bounds(self, "ParallelConfig")

    @property
    def model_parallel_size(self) -> int:
        """The ranks that hold the same rows of a batch (one data-parallel rank's group)."""
        return self.sequence_parallel_size * self.tensor_parallel_size

    def data_parallel_size(self, world_size: int, section: str = "actor") -> int:
        """The data dimension of a `world_size`-rank trainer; a clear error when the sequence
        and tensor sizes do not divide it."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"{section}.parallel.sequence_parallel_size={self.sequence_parallel_size} x "
                f"{section}.parallel.tensor_parallel_size={self.tensor_parallel_size} = "
                f"{self.model_parallel_size} does not divide the trainer's world size "
                f"{world_size} (launcher.n_trainer_procs): the mesh would not fill it")
        return world_size // self.model_parallel_size

    def data_parallel_rank(self, rank: int) -> int:
        """Which data-parallel rank (which rows of a batch) global `rank` serves."""
        return rank // self.model_parallel_size
