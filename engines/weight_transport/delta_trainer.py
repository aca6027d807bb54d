"""The trainer's end of the delta transport (`rollout.weights.transport=delta`): rank 0 keeps
the weights it last sent the fleet (on the host) and writes each new version as a weight file
of what changed since then (`engines/weight_transport/delta/`); a full file of the version
only when a server asks for one (it does not hold the delta's base: restarted, added, or it
missed an update).

Bytes that changed are found exactly (the tensors' integer views compared), so a delta
applied to its base is bit-identical to the new weights, which the receiver checks against
every tensor's digest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from engines.weight_transport.delta.areal_like_weight_delta import (
    WeightFileWriter,
    state_digest,
)

logger = logging.getLogger("engines.weight_transport.delta_trainer")


@dataclass
class DeltaFileStats:
    """What one version's file holds: bytes written, elements changed, tensors changed."""

    kind: str  # delta | full
    file_bytes: int
    raw_bytes: int  # the weights' own size
    changed_elements: int
    elements: int
    changed_tensors: int
    tensors: int

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / max(self.elements, 1)


class DeltaSender:
    """Rank 0's weight files under `directory` (the servers read them: a shared directory).

    `begin(version)`, `add(names, tensors)` per bucket, `finish()`: the file of `version`
    (a delta against the last finished version, or full the first time). Old files beyond
    the last `keep` versions are removed."""

    def __init__(self, directory: Path, codec: str = "xor", level: int = 1,
                 keep: int = 2) -> None:
        self.directory = directory.resolve()  # servers may run elsewhere: absolute paths
        self.codec = codec
        self.level = level
        self.keep = keep
        self.held: dict[str, torch.Tensor] = {}  # what the fleet was last sent, by name
        self.digests: dict[str, str] = {}
        self.version: Optional[int] = None
        self._writer: Optional[WeightFileWriter] = None
        self._stats: Optional[DeltaFileStats] = None
        self._full: dict[int, Path] = {}  # version -> its full file, once written
        self._full_lock = threading.Lock()

    @property
    def state_digest(self) -> str:
        return state_digest(self.digests)

    def begin(self, version: int) -> tuple[Path, Optional[int], str]:
        """Start the file of `version`: its path, and the version and state digest it is a
        delta against (None, "": a full file)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        full = self.version is None
        path = self.directory / f"v{version}.{'full' if full else 'delta'}"
        base_version, base_digest = (None, "") if full else (self.version, self.state_digest)
        self._writer = WeightFileWriter(path, version, base_version, base_digest, self.codec,
                                        self.level)
        self._stats = DeltaFileStats("full" if full else "delta", 0, 0, 0, 0, 0, 0)
        return path, base_version, base_digest

    def add(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        writer, stats = self._require_writer()
        for name, tensor in zip(names, tensors, strict=True):
            new = tensor.detach().to("cpu", copy=True) if tensor.device.type != "cpu" \
                else tensor.detach().clone()
            entry = writer.add(name, new, self.held.get(name))
            self.held[name] = new
            stats.raw_bytes += new.numel() * new.element_size()
            stats.changed_elements += entry.changed_elements
            stats.elements += entry.elements
            stats.changed_tensors += int(entry.changed_elements > 0)
            stats.tensors += 1

    def finish(self, version: int) -> DeltaFileStats:
        """Publish the file begun for `version`; what it holds."""
        writer, stats = self._require_writer()
        stats.file_bytes = writer.close()
        self._writer = None
        self.digests = dict(writer.digests)
        self.version = version
        if writer.header["base_version"] is None:
            self._full[version] = writer.path
        self._remove_old(version)
        return stats

    def abandon(self) -> None:
        """An update that failed halfway: what the fleet holds is unknown to this end, so
        the next file is full."""
        if self._writer is not None:
            self._writer.discard()
            self._writer = None
        self.held, self.digests, self.version = {}, {}, None

    def full_file(self, version: int) -> str:
        """The full file of `version` (the last finished), written once when first asked
        for (thread-safe: servers falling back at once share it)."""
        with self._full_lock:
            if self.version != version:
                raise RuntimeError(f"a full weight file of version {version} was asked for; "
                                   f"this trainer holds version {self.version}")
            if version not in self._full:
                path = self.directory / f"v{version}.full"
                writer = WeightFileWriter(path, version, None, "", self.codec, self.level)
                try:
                    for name, tensor in self.held.items():
                        writer.add(name, tensor, None)
                    writer.close()
                except BaseException:
                    writer.discard()
                    raise
                self._full[version] = path
                logger.info("wrote the full weight file of version %d for servers without "
                            "the delta's base: %s", version, path)
            return str(self._full[version])

    def _require_writer(self) -> tuple[WeightFileWriter, DeltaFileStats]:
        if self._writer is None or self._stats is None:
            raise RuntimeError("DeltaSender.add/finish before begin(version)")
        return self._writer, self._stats

    def _remove_old(self, version: int) -> None:
        for path in self.directory.glob("v*.*"):
            stem = path.name[1:].split(".", 1)[0]
            if stem.isdigit() and int(stem) <= version - self.keep:
                path.unlink(missing_ok=True)
        self._full = {v: p for v, p in self._full.items() if v > version - self.keep}
        receipts = self.directory / "receipts"
        if receipts.is_dir():
            for path in receipts.iterdir():
                stem = path.name.split("-", 1)[0]
                if stem.isdigit() and int(stem) <= version - self.keep:
                    path.unlink(missing_ok=True)
