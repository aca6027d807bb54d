"""The Tinker API's binary messages and losses, checked against the `tinker` SDK itself (its
descriptor, its encoder of forward_backward requests, its decoders of our replies) and the
losses against float64 formulas written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from google.protobuf import descriptor_pb2
from tensordict import TensorDict
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as sdk_pb

from areal_like.tinker import losses, wire, wire_proto
from areal_like.tinker.errors import UserError


def _messages(file: descriptor_pb2.FileDescriptorProto) -> dict[str, list[tuple]]:
    """message -> its fields (name, number, type, label, type's short name, proto3 optional),
    nested map entries as messages of their own."""
    out: dict[str, list[tuple]] = {}

    def add(msg: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        out[prefix + msg.name] = [(f.name, f.number, f.type, f.label,
                                   f.type_name.rsplit(".", 1)[-1], f.proto3_optional,
                                   msg.oneof_decl[f.oneof_index].name
                                   if f.HasField("oneof_index") else "")
                                  for f in msg.field]
        for nested in msg.nested_type:
            add(nested, f"{prefix}{msg.name}.")
    for msg in file.message_type:
        add(msg, "")
    return out


def test_our_messages_match_the_sdks_field_for_field() -> None:
    sdk = descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(sdk)
    ours, theirs = _messages(wire_proto.build_file()), _messages(sdk)
    assert set(ours) <= set(theirs)
    for name, fields in ours.items():
        assert fields == theirs[name], name
    assert {"ForwardBackwardRequest", "ForwardBackwardOutput", "SampleResponse"} <= set(ours)
    sdk_enums = {e.name: [(v.name, v.number) for v in e.value] for e in sdk.enum_type}
    for enum in wire_proto.build_file().enum_type:
        assert [(v.name, v.number) for v in enum.value] == sdk_enums[enum.name]


def test_a_request_the_sdk_encodes_decodes_to_its_values() -> None:
    rng = np.random.default_rng(0)
    weights_2d = torch.zeros(3, 4)
    weights_2d[1, 2] = 0.5  # mostly zeros: the SDK sends it as a sparse CSR tensor
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9],
                                        "logprobs": rng.normal(size=4).astype(np.float32),
                                        "advantages": [0.0, 1.0, 1.0, -2.0]}),
            types.Datum(model_input=types.ModelInput(chunks=[
                types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])]),
                loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": weights_2d})]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "tag": "x"}),
        model_id="s:train:0", seq_id=7)
    body = request_conv.forward_backward_request_to_proto(request).SerializeToString()
    call = wire.decode_forward_backward(body)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == (
        "s:train:0", 7, "ppo", False)
    assert call.config == {"clip_low_threshold": pytest.approx(0.7), "tag": "x"}
    assert call.data[0].tokens.tolist() == [5, 6, 7, 8]
    assert call.data[1].tokens.tolist() == [1, 2, 3]
    assert call.data[0].inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(call.data[0].inputs["logprobs"],
                                  data[0].loss_fn_inputs["logprobs"].to_numpy())
    np.testing.assert_array_equal(call.data[1].inputs["weights"], weights_2d.numpy())
    with pytest.raises(UserError, match="not a ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff")


def test_our_outputs_and_samples_decode_in_the_sdk() -> None:
    outputs = [{"logprobs": np.array([-1.0, -2.0, -0.5], np.float32),
                "elementwise_loss": np.array([0.0, 2.0, 0.5], np.float32)},
               {"logprobs": np.array([-3.0], np.float32),
                "elementwise_loss": np.array([3.0], np.float32)}]
    decoded = response_conv.deserialize_forward_backward_output(
        wire.encode_forward_backward_output(outputs, {"loss:sum": 5.5}))
    assert decoded.metrics == {"loss:sum": 5.5}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0, -0.5],
                                                                          [-3.0]]
    assert decoded.loss_fn_outputs[1]["elementwise_loss"].tolist() == [3.0]

    ids = np.array([[0, 0], [4, 9], [7, 1]])
    lps = np.array([[-99999.0, -99999.0], [-0.1, -2.5], [-0.3, -1.5]])
    sample = response_conv.deserialize_sample_response(wire.encode_sample_response(
        [wire.SampledSequence([4, 5, 2], [-0.5, -1.0, -0.25], stopped=True),
         wire.SampledSequence([9], [-3.0], stopped=False)],
        prompt_logprobs=[float("nan"), -0.1, -0.3], topk_prompt=(ids, lps)))
    assert [s.tokens for s in sample.sequences] == [[4, 5, 2], [9]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[0].logprobs == [-0.5, -1.0, -0.25]
    assert sample.prompt_logprobs[0] is None and sample.prompt_logprobs[1:] == pytest.approx(
        [-0.1, -0.3])
    assert sample.topk_prompt_logprobs[1] == [(4, pytest.approx(-0.1)), (9, -2.5)]


# ---- the losses, against float64 formulas -------------------------------------------------
def _reference_loss(name: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor],
                    lo: float = 0.8, hi: float = 1.2) -> torch.Tensor:
    """Tinker's documented per-token losses, token by token in float64."""
    out = []
    for t in range(lp.shape[0]):
        if name == "cross_entropy":
            out.append(-inputs["weights"][t] * lp[t])
            continue
        a, q = inputs["advantages"][t], inputs["logprobs"][t]
        r = torch.exp(lp[t] - q)
        if name == "importance_sampling":
            out.append(-r * a)
        elif name == "ppo":
            out.append(-torch.minimum(r * a, torch.clamp(r, lo, hi) * a))
        else:  # cispo: the clipped ratio is a constant weight on the policy gradient
            out.append(-float(torch.clamp(r.detach(), lo, hi)) * lp[t] * a)
    return torch.stack(out)


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_each_loss_and_its_gradient_match_the_formula_in_float64(name: str) -> None:
    torch.manual_seed(0)
    n_tokens, vocab = 9, 11
    logits = torch.randn(n_tokens, vocab, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n_tokens,))
    inputs = {"weights": torch.rand(n_tokens, dtype=torch.float64),
              "logprobs": -torch.rand(n_tokens, dtype=torch.float64) * 3,
              "advantages": torch.randn(n_tokens, dtype=torch.float64)}
    mb = TensorDict({losses.TARGETS: targets, **{losses.INPUT_KEYS[k]: v
                                                 for k, v in inputs.items()}}, batch_size=[])
    config = losses.check_loss(name, {})
    ours = losses.packed_loss(name, config)(logits, mb)
    (grad_ours,) = torch.autograd.grad(ours, logits)

    reference_logits = logits.detach().clone().requires_grad_(True)
    lp = torch.stack([torch.log(torch.exp(reference_logits[t, targets[t]])
                                / torch.exp(reference_logits[t]).sum())
                      for t in range(n_tokens)])
    reference = _reference_loss(name, lp, inputs).sum()
    (grad_ref,) = torch.autograd.grad(reference, reference_logits)
    # (log_softmax runs in float32 inside the loss, as on the trainer: float32 tolerances)
    assert math.isclose(float(ours.detach()), float(reference.detach()), rel_tol=1e-5,
                        abs_tol=1e-5)
    assert float((grad_ours - grad_ref).abs().max()) < 1e-5
    outputs = losses.packed_outputs(name, config)(logits.detach(), mb)
    assert torch.allclose(outputs[:, 0].double(), lp.detach(), atol=1e-5)
    assert torch.allclose(outputs[:, 1].double(), _reference_loss(name, lp, inputs).detach(),
                          atol=1e-5)


def test_ppo_clips_at_the_configured_thresholds() -> None:
    """A ratio of e^1 with a positive advantage is clipped at 1.2 (no gradient through
    it) by default, at 3.0 when configured so."""
    lp = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    mb = TensorDict({losses.SAMPLER_LOGPROBS: torch.tensor([-1.0], dtype=torch.float64),
                     losses.ADVANTAGES: torch.tensor([1.0], dtype=torch.float64)},
                    batch_size=[])
    clipped = losses.elementwise_loss("ppo", losses.check_loss("ppo", {}), lp, mb)
    assert float(clipped.detach()) == pytest.approx(-1.2)
    assert torch.autograd.grad(clipped.sum(), lp)[0].item() == 0.0
    wide = losses.elementwise_loss("ppo", losses.check_loss(
        "ppo", {"clip_high_threshold": 3.0}), lp, mb)
    assert float(wide.detach()) == pytest.approx(-math.e)


def test_unsupported_losses_and_config_keys_are_named() -> None:
    with pytest.raises(UserError, match=r"loss_fn 'dro' is not supported.*cross_entropy"):
        losses.check_loss("dro", {})
    with pytest.raises(UserError, match=r"\['beta'\] are not taken by 'ppo'"):
        losses.check_loss("ppo", {"beta": 0.1})
    with pytest.raises(UserError, match="clip thresholds"):
        losses.check_loss("cispo", {"clip_low_threshold": 1.5})
