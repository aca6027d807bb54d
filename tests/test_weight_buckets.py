"""Bucket planning and the flattened-bucket layout of the distributed weight transport (the
layout SGLang's receiver views in place: each tensor's bytes, concatenated in order)."""

from __future__ import annotations

import pytest
import torch

from areal_like.api.io_struct import ParamSpec, WeightUpdateMeta
from engines.weight_transport.process_group_trainer import flatten_bucket, plan_buckets


def _spec(name: str, dtype: str, *shape: int) -> ParamSpec:
    return ParamSpec(name, dtype, tuple(shape))


def test_buckets_keep_order_and_size_and_oversized_tensors_go_alone():
    specs = [_spec("a", "float32", 10), _spec("b", "float32", 20), _spec("c", "float32", 100),
             _spec("d", "float32", 5), _spec("e", "float32", 5)]
    buckets = plan_buckets(specs, bucket_bytes=128)  # 32 float32 per bucket
    assert [[p.name for p in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert [p for b in buckets for p in b] == specs
    assert all(sum(p.nbytes for p in b) <= 128 for b in buckets if len(b) > 1)


def test_a_tensor_never_starts_at_a_misaligned_offset():
    specs = [_spec("odd", "bfloat16", 3), _spec("f", "float32", 2), _spec("g", "float32", 2)]
    buckets = plan_buckets(specs, bucket_bytes=1024)
    for bucket in buckets:
        offset = 0
        for p in bucket:
            assert offset % p.itemsize == 0, (p, offset)
            offset += p.nbytes
    assert [p.name for p in buckets[0]] == ["odd"]  # 6 bytes: "f" would start unaligned


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets([_spec("a", "float32", 1)], 0)
    with pytest.raises(ValueError, match="dtype"):
        _spec("a", "complex64", 1)
    with pytest.raises(ValueError, match="buckets"):
        WeightUpdateMeta(version=1, type="distributed")


def test_flattened_bucket_reconstructs_every_tensor_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=gen), torch.randn(2, 2, generator=gen).t(),
               torch.randn(5, generator=gen).bfloat16()]  # a non-contiguous view, 2 dtypes
    flat = flatten_bucket(tensors, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size()
                                                             for t in tensors)
    offset = 0
    for t in tensors:  # the receiver's view of each slice
        n = t.numel() * t.element_size()
        got = flat[offset:offset + n].view(t.dtype).reshape(t.shape)
        assert torch.equal(got, t)
        offset += n
