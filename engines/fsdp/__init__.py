"""Helpers of the FSDP2 train engine: packed attention, process groups, optimiser, checkpoints."""
