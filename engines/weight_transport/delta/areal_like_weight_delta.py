"""Weight files of the delta transport (`rollout.weights.transport=delta`), both ends.

A file holds one version of the weights, in the tensors' own names (HF names, as a full
folder or a broadcast carries them): either every tensor (`full`) or what changed since
`base_version` (`delta`). Per tensor: `same` (no bytes), `xor` (the integer view of the new
bytes XOR the base's: unchanged high bits and elements become zero runs), `sparse` (indices
of the changed elements + their new values), or `raw`; each payload compressed with zstd.
Every tensor carries the SHA-256 digest of its new bytes, and the file the digest of the
whole state before (`base_state_digest`) and after (`state_digest`), so a receiver proves
what it applied is bit-identical to the sender's tensors.

Layout: magic, payloads, footer JSON, then 8 bytes of footer length and 16 of footer digest
(the footer is written last, so a file is written in one pass).

The receiver's end (`HeldWeights.apply_file`) is called inside an inference server (SGLang's
custom weight loader `load_weight_file` below; vLLM's worker extension), so this module imports
only torch and zstandard. It keeps the weights it last applied on the host (its base for the
next delta), checks everything before it loads anything, and never raises: what happened is
returned as a receipt (a refusal leaves the model untouched).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

MAGIC = b"AREAL_LIKE_WEIGHTS_1\n"
TRAILER = struct.Struct("<Q16s")  # footer length, footer digest
CODECS = ("xor", "sparse")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# a tensor of a wider element (complex128) is compared and XORed as int64 pairs


class WeightFileError(ValueError):
    """A weight file that cannot be applied here (the message says why)."""


def tensor_digest(t: torch.Tensor) -> str:
    # SHA-256 (128 bits kept): hardware-accelerated on current CPUs, twice BLAKE2b's speed
    return hashlib.sha256(_bytes_of(t)).hexdigest()[:32]


def state_digest(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}:{digests[name]}\n".encode())
    return h.hexdigest()[:32]


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().view(-1)
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array) if flat.numel() else memoryview(b"")


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(_INT_OF_SIZE.get(t.element_size(),
                                                                  torch.int64))


def _compressor(level: int) -> Any:
    import zstandard

    return zstandard.ZstdCompressor(level=level)


def _decompress(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data)


# ---- writing (the trainer) ------------------------------------------------------------------
@dataclass
class EntryStats:
    changed_elements: int
    elements: int
    payload_bytes: int


class WeightFileWriter:
    """One weight file, written tensor by tensor (`add`), published by `close` (atomic)."""

    def __init__(self, path: Path, version: int, base_version: Optional[int],
                 base_state_digest: str, codec: str = "xor", level: int = 1) -> None:
        if codec not in CODECS:
            raise ValueError(f"delta codec {codec!r}: use one of {CODECS}")
        self.path = path
        self.codec = codec
        self._tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - open until close()
        self._file.write(MAGIC)
        self._offset = len(MAGIC)
        self._zstd = _compressor(level)
        self.entries: list[dict[str, Any]] = []
        self.digests: dict[str, str] = {}
        self.header: dict[str, Any] = {
            "kind": "full" if base_version is None else "delta", "version": version,
            "base_version": base_version, "base_state_digest": base_state_digest}

    def add(self, name: str, new: torch.Tensor, base: Optional[torch.Tensor]) -> EntryStats:
        """`new` against `base` (None: sent whole)."""
        new = new.detach().contiguous()
        digest = tensor_digest(new)
        self.digests[name] = digest
        entry: dict[str, Any] = {"name": name, "dtype": str(new.dtype).removeprefix("torch."),
                                 "shape": list(new.shape), "digest": digest}
        changed = new.numel()
        payload: Any
        if base is None:
            entry["codec"], payload = "raw", _bytes_of(new)
        else:
            if base.shape != new.shape or base.dtype != new.dtype:
                raise WeightFileError(f"{name}: {tuple(new.shape)} {new.dtype} against a base "
                                      f"of {tuple(base.shape)} {base.dtype}")
            a, b = _as_int(new), _as_int(base)
            x = a ^ b  # zero where unchanged
            changed = int(torch.count_nonzero(x))
            if changed == 0:
                entry["codec"], payload = "same", b""
            elif self.codec == "xor":
                entry["codec"], payload = "xor", _bytes_of(x)
            else:
                where = x.nonzero().view(-1)
                gaps = torch.diff(where, prepend=where.new_zeros(1)).to(torch.int64)
                entry["codec"] = "sparse"
                payload = struct.pack("<Q", changed) + bytes(_bytes_of(gaps)) \
                    + bytes(_bytes_of(a[where]))
        if len(payload):
            payload = self._zstd.compress(payload)
        entry["offset"], entry["length"] = self._offset, len(payload)
        self._file.write(payload)
        self._offset += len(payload)
        self.entries.append(entry)
        return EntryStats(changed, new.numel(), len(payload))

    def close(self) -> int:
        """Write the footer and publish the file; returns its size in bytes."""
        footer = json.dumps({**self.header, "state_digest": state_digest(self.digests),
                             "entries": self.entries}).encode()
        self._file.write(footer)
        self._file.write(TRAILER.pack(len(footer), hashlib.blake2b(footer,
                                                                   digest_size=16).digest()))
        self._file.close()
        os.replace(self._tmp, self.path)
        return self._offset + len(footer) + TRAILER.size

    def discard(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


# ---- reading (a server) ---------------------------------------------------------------------
def read_footer(data: bytes, path: str) -> dict[str, Any]:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + TRAILER.size:
        raise WeightFileError(f"{path} is not a weight file (bad magic or truncated)")
    length, digest = TRAILER.unpack(data[-TRAILER.size:])
    start = len(data) - TRAILER.size - length
    if start < len(MAGIC):
        raise WeightFileError(f"{path}: footer length {length} does not fit the file")
    footer = data[start:len(data) - TRAILER.size]
    if hashlib.blake2b(footer, digest_size=16).digest() != digest:
        raise WeightFileError(f"{path}: the footer's checksum does not match (corrupted)")
    return dict(json.loads(footer))


def _decode(data: bytes, entry: dict[str, Any], base: Optional[torch.Tensor]) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    shape = tuple(entry["shape"])
    codec = entry["codec"]
    if 0 in shape and codec != "same":
        return torch.empty(shape, dtype=dtype)
    if codec == "same":
        if base is None:
            raise WeightFileError(f"{entry['name']}: unchanged, but this server holds no base")
        return base
    payload = _decompress(data[entry["offset"]:entry["offset"] + entry["length"]])
    if codec == "raw":
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)
    if base is None:
        raise WeightFileError(f"{entry['name']}: a {codec} delta, but this server holds no base")
    b = _as_int(base)
    if codec == "xor":
        x = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(b.dtype)
        return (b ^ x).view(dtype).view(shape)
    if codec == "sparse":
        (count,) = struct.unpack_from("<Q", payload)
        gaps = torch.frombuffer(bytearray(payload[8:8 + 8 * count]), dtype=torch.int64)
        values = torch.frombuffer(bytearray(payload[8 + 8 * count:]), dtype=torch.uint8)
        out = b.clone()
        out[torch.cumsum(gaps, 0)] = values.view(b.dtype)
        return out.view(dtype).view(shape)
    raise WeightFileError(f"{entry['name']}: unknown codec {codec!r}")


@dataclass
class HeldWeights:
    """The weights a server holds (in the sender's names), its base for the next delta."""

    version: Optional[int] = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    fingerprint: str = ""  # of the model right after the last apply (`model_fingerprint`)

    def apply_file(self, path: str, load: Callable[[list[tuple[str, torch.Tensor]],
                                                    dict[str, torch.Tensor]], None],
                   model_digest: Optional[Callable[[], str]] = None,
                   fingerprint: Optional[Callable[[], str]] = None) -> dict[str, Any]:
        """Apply the weight file at `path` through `load(changed, whole_state)`; the receipt
        (never raises). Refused (model untouched): unreadable, corrupted, a delta whose base
        this server does not hold (nor its model: `fingerprint()` differs from the last
        apply's, the weights were loaded another way since), a different model's tensors."""
        start = time.perf_counter()
        receipt: dict[str, Any] = {"path": path, "applied": False, "held_version": self.version}
        try:
            data = Path(path).read_bytes()
            footer = read_footer(data, path)
            receipt.update(kind=footer["kind"], version=footer["version"])
            if footer["kind"] == "delta" and fingerprint is not None \
                    and fingerprint() != self.fingerprint:
                raise BaseMismatch("this server's weights changed since its last weight file "
                                   "(loaded another way): it holds no base for a delta")
            changed = self._verified(data, footer, path)
        except Exception as e:  # noqa: BLE001 - a refusal, reported; the model is untouched
            receipt.update(refused=_reason(e), error=f"{type(e).__name__}: {e}"[:1000])
            return receipt
        state = {**self.tensors, **dict(changed)}
        try:
            load(changed, state)
        except Exception as e:  # noqa: BLE001 - the model may hold part of it: reported
            self.version, self.tensors, self.digests = None, {}, {}
            receipt.update(refused="load", partial=True, error=f"{type(e).__name__}: {e}"[:1000])
            return receipt
        try:
            self.fingerprint = fingerprint() if fingerprint is not None else ""
            if model_digest is not None:
                receipt["model_digest"] = model_digest()
        except Exception as e:  # noqa: BLE001 - loaded, but unverifiable: no base kept
            self.version, self.tensors, self.digests = None, {}, {}
            receipt.update(refused="load", partial=True,
                           error=f"after the load: {type(e).__name__}: {e}"[:1000])
            return receipt
        self.tensors = state
        self.digests = {e["name"]: e["digest"] for e in footer["entries"]}
        self.version = int(footer["version"])
        receipt.update(applied=True, tensors_loaded=len(changed), held_version=self.version,
                       state_digest=state_digest(self.digests), seconds=time.perf_counter() - start)
        return receipt

    def _verified(self, data: bytes, footer: dict[str, Any],
                  path: str) -> list[tuple[str, torch.Tensor]]:
        entries = footer["entries"]
        if footer["kind"] == "delta" and (
                self.version is None or self.version != footer["base_version"]
                or state_digest(self.digests) != footer["base_state_digest"]):
            raise BaseMismatch(f"{path} is a delta against version {footer['base_version']}; "
                               f"this server holds {self.version}")
        if self.tensors:
            names = {e["name"] for e in entries}
            if names != set(self.tensors):
                missing = sorted(set(self.tensors) - names)[:3]
                extra = sorted(names - set(self.tensors))[:3]
                raise ModelMismatch(f"{path} holds other tensors than this server's (missing "
                                      f"{missing}, unknown {extra}): another model")
        changed = []
        for entry in entries:
            if entry["codec"] == "same":
                if self.digests.get(entry["name"]) != entry["digest"]:
                    raise WeightFileError(f"{entry['name']}: unchanged in {path}, but this "
                                          "server's copy differs")
                continue
            tensor = _decode(data, entry, self.tensors.get(entry["name"]))
            if tensor_digest(tensor) != entry["digest"]:
                raise ChecksumMismatch(f"{entry['name']}: the decoded bytes do not match their "
                                       f"checksum in {path} (corrupted)")
            changed.append((entry["name"], tensor))
        digests = {**self.digests, **{e["name"]: e["digest"] for e in entries}}
        if state_digest(digests) != footer["state_digest"]:
            raise ChecksumMismatch(f"{path}: the state after it does not match its checksum")
        return changed


class BaseMismatch(WeightFileError):
    pass


class ChecksumMismatch(WeightFileError):
    pass


class ModelMismatch(WeightFileError):
    pass


def _reason(error: BaseException) -> str:
    """The refusal's kind: base | model | corrupt | unreadable."""
    if isinstance(error, BaseMismatch):
        return "base"
    if isinstance(error, ModelMismatch):
        return "model"
    if isinstance(error, OSError):
        return "unreadable"
    return "corrupt"  # checksums, an unparsable footer, zstd's own errors


def parameters_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of a model's own parameters (its layout), to compare two servers'."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(_bytes_of(t.detach().cpu()))
    return h.hexdigest()


def model_fingerprint(named: Iterable[tuple[str, torch.Tensor]], n: int = 16) -> str:
    """A cheap digest of a model's parameters: the first and last `n` elements of each (a
    load of other weights changes nearly every tensor's)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(named, key=lambda item: item[0]):
        flat = t.detach().reshape(-1)
        h.update(name.encode())
        h.update(_bytes_of(torch.cat([flat[:n], flat[-n:]]).cpu()))
    return h.hexdigest()


def write_receipt(path: str, receipt: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(receipt, f)
    os.replace(tmp, path)


# ---- SGLang's custom weight loader (`--custom-weight-loader`) -------------------------------
HELD: dict[int, HeldWeights] = {}  # this process's, per model (one tensor-parallel rank)


def load_weight_file(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's `/update_weights_from_tensor` with this function as `load_format`: the one
    "tensor" is a placeholder whose name is the request ({"path", "receipt", "model_digest"}).
    Writes the receipt to `receipt` + ".<tp rank>"; never raises (an exception here would end
    SGLang's scheduler)."""
    try:
        _load_weight_file(model, named_tensors)
    except BaseException as e:  # noqa: BLE001 - never out of here: it would end the scheduler
        print(f"areal_like_weight_delta: {type(e).__name__}: {e}", flush=True)


def _load_weight_file(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    rank = 0
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialised: one rank
        pass
    request = json.loads(named_tensors[0][0])
    receipt_path = f"{request['receipt']}.{rank}"
    held = HELD.setdefault(id(model), HeldWeights())  # a draft model holds its own

    def load(changed: list[tuple[str, torch.Tensor]], state: dict[str, torch.Tensor]) -> None:
        device = next(model.parameters()).device
        # one tensor on the device at a time (a full file is the whole model)
        model.load_weights((name, t.to(device)) for name, t in changed)

    digest = (lambda: parameters_digest(model.named_parameters())) \
        if request.get("model_digest") else None
    try:
        receipt = held.apply_file(str(request["path"]), load, digest,
                                  lambda: model_fingerprint(model.named_parameters()))
    except BaseException as e:  # noqa: BLE001 - reported in the receipt
        HELD.pop(id(model), None)
        receipt = {"applied": False, "refused": "load", "partial": True,
                   "error": f"{type(e).__name__}: {e}"[:1000]}
    write_receipt(receipt_path, receipt)
