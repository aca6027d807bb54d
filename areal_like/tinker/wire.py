"""The Tinker API's binary messages to and from Python values: a forward(_backward) request
into its datums, their outputs and a sample's result into the bytes the SDK decodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from areal_like.tinker import wire_proto as pb
from areal_like.tinker.errors import UserError

ConfigValue = Union[float, str]
_NUMPY: dict[int, np.dtype[Any]] = {pb.DTYPE_FLOAT32: np.dtype("<f4"),
                                    pb.DTYPE_INT64: np.dtype("<i8"),
                                    pb.DTYPE_INT32: np.dtype("<i4")}


@dataclass
class Datum:
    """One sequence: its tokens (the model input) and per-token loss inputs by name."""

    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, ConfigValue]
    forward_only: bool
    data: list[Datum]
    # why its data cannot be trained on: refused in its turn, so its seq_id is used and the
    # model's next call does not wait for it
    refused: Optional[str] = None


def decode_forward_backward(body: bytes, content_encoding: str = "") -> ForwardBackwardCall:
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    elif content_encoding not in ("", "identity"):
        raise UserError(f"Content-Encoding {content_encoding!r}: expected zstd or none")
    try:
        request = pb.ForwardBackwardRequest.FromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise UserError(f"the forward_backward body is not a ForwardBackwardRequest "
                        f"protobuf message: {e}") from e
    config: dict[str, ConfigValue] = {k: float(v) for k, v in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():  # preferred: numbers and strings
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    try:
        data, refused = [_decode_datum(d, i) for i, d in enumerate(request.data)], None
    except UserError as e:
        data, refused = [], str(e)
    return ForwardBackwardCall(request.model_id, int(request.seq_id), request.loss_fn, config,
                               bool(request.forward_only), data, refused)


def _decode_datum(datum: Any, index: int) -> Datum:
    tokens: list[np.ndarray] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"datum {index}: a model_input chunk of type {kind!r}; this server "
                            f"trains text models (encoded_text chunks) only")
        tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
    ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    if ids.size == 0:
        raise UserError(f"datum {index}: model_input has no tokens")
    inputs = {name: decode_tensor(t, f"datum {index}: loss_fn_inputs[{name!r}]")
              for name, t in datum.loss_fn_inputs.items()}
    return Datum(ids, inputs)


def decode_tensor(tensor: Any, where: str) -> np.ndarray:
    t = tensor  # a wire_proto Tensor
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise UserError(f"{where}: dtype {t.dtype} is not float32, int64 or int32")
    shape = tuple(int(s) for s in t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        csr = t.sparse_csr
        if len(shape) != 2:
            raise UserError(f"{where}: a sparse (CSR) tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype="<i8")
        cols = np.frombuffer(csr.col_indices, dtype="<i8")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, cols] = values
        return dense
    flat = np.frombuffer(t.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != flat.size:
        raise UserError(f"{where}: {flat.size} values for shape {shape}")
    return flat.reshape(shape) if shape else flat


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]],
                                   metrics: dict[str, float]) -> bytes:
    """One ArrayRecord holding every datum's outputs (float32 [N] each), and the metrics
    (`name:reduction` keys, as the SDK combines chunks by the reduction)."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        parts = [np.ascontiguousarray(o[name], dtype="<f4") for o in outputs]
        offsets = np.cumsum([0] + [p.nbytes for p in parts]).astype("<i8")
        batched = record.fields[name]
        batched.data = b"".join(p.tobytes() for p in parts)
        batched.offsets = offsets.tobytes()
        batched.dtype = pb.DTYPE_FLOAT32
        batched.trailing_shape.extend(parts[0].shape[1:])
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    return bytes(message.SerializeToString())


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # True: EOS or a stop sequence; False: max_tokens


def encode_sample_response(sequences: list[SampledSequence],
                           prompt_logprobs: Optional[list[float]] = None,
                           topk_prompt: Optional[tuple[np.ndarray, np.ndarray]] = None
                           ) -> bytes:
    """`topk_prompt`: (token ids int [len, k], log-probs [len, k]) per prompt position."""
    message = pb.SampleResponse()
    for seq in sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes())
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    if topk_prompt is not None:
        ids, lps = topk_prompt
        message.topk_prompt_logprobs.token_ids = np.ascontiguousarray(ids, "<i4").tobytes()
        message.topk_prompt_logprobs.logprobs = np.ascontiguousarray(lps, "<f4").tobytes()
        message.topk_prompt_logprobs.length, message.topk_prompt_logprobs.k = ids.shape
    return bytes(message.SerializeToString())
