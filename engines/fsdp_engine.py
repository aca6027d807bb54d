"""Old import path of the FSDP2 train engine (`engines.fsdp.engine`)."""

from engines.fsdp.engine import FSDPEngine

__all__ = ["FSDPEngine"]
