"""Byte-level comparisons shared by the test modules (bit-exact means the same bytes)."""

from __future__ import annotations

import pytest
import torch

#: the marks of a test (or a parameter) that needs a CUDA device: ``cuda`` (select with ``-m cuda``),
#: skipped without one
CUDA_MARKS = (pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


def requires_cuda(fn):
    """Mark a test ``cuda`` (select with ``-m cuda``) and skip it without a CUDA device."""
    for mark in CUDA_MARKS:
        fn = mark(fn)
    return fn


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (works for 0-d tensors and NaN payloads)."""
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8)


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bytes (bit-exact, NaN payloads included)."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    ra, rb = raw_bytes(a), raw_bytes(b)
    if not torch.equal(ra, rb):
        n = int((ra != rb).sum())
        raise AssertionError(f"{what}: {n} of {ra.numel()} bytes differ")


def assert_same_components(a, b, what: str = "") -> None:
    """Two QuantizedTensors hold the same component names and bytes."""
    ca, cb = a.components(), b.components()
    assert sorted(ca) == sorted(cb), f"{what}: components {sorted(ca)} != {sorted(cb)}"
    for k in ca:
        assert_same_bytes(ca[k], cb[k], f"{what} component '{k}'")
