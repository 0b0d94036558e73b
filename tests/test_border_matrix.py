"""A fast subset of scripts/border_matrix.py: folders written by compressed-tensors' own code, through
ckptq (import, native DCP, export), loaded by transformers' ``from_pretrained`` with no arguments.

The full table (every producer x format x model dtype) is ``python scripts/border_matrix.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "border_matrix.py"


@pytest.fixture(scope="module")
def bm():
    spec = importlib.util.spec_from_file_location("border_matrix", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["border_matrix"] = mod
    spec.loader.exec_module(mod)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return mod


def _producer(bm, name):
    return next(p for p in bm.PRODUCERS if p.name == name)


@pytest.mark.parametrize(
    "fmt,dtype",
    [("fp8_tensor", "bfloat16"), ("fp8_block", "float16"), ("fp8_row", "bfloat16"), ("mxfp8", "bfloat16")],
)
def test_compressed_tensors_folders_round_trip_bytes_and_decode(bm, tmp_path, fmt, dtype):
    """bf16 / fp16 scales in the producer's shapes: the export writes the source bytes, and
    transformers decodes every weight as ckptq dequantizes it."""
    cell = bm.run_row(_producer(bm, "compressed-tensors"), fmt, dtype, "compressed-tensors", tmp_path)
    assert cell == "bytes equal, decode equal"


def test_compressed_tensors_mxfp8_in_a_float32_model_is_refused(bm, tmp_path):
    """compressed-tensors 0.20 decodes MXFP8 to bf16; in a fp32 model the producer's own folder fails
    transformers' forward, and ckptq's export refuses rather than writing such a folder silently."""
    cell = bm.run_row(_producer(bm, "compressed-tensors"), "mxfp8", "float32", "compressed-tensors", tmp_path)
    assert cell.startswith("refused (") and "decodes MXFP8 to bfloat16" in cell
    assert "the producer's folder itself: consumer fails" in cell


def test_ckptq_fp8_tensor_in_a_bf16_model_refuses_and_its_choices_decode_exactly(bm, tmp_path):
    """ckptq's fp32 per-tensor scales are not bf16 values: refused with the difference; both exact
    choices load in transformers equal to ckptq's dequantization."""
    cell = bm.run_row(_producer(bm, "ckptq"), "fp8_tensor", "bfloat16", "compressed-tensors", tmp_path)
    assert cell.startswith("refused (") and "max abs diff" in cell
    assert "--on-inexact float32: decode equal" in cell
    assert "--on-inexact requantize: decode equal (of the requantized values" in cell


def test_markdown_table(bm):
    rows = [{"producer": "p", "format": "f", "layout": "l", "dtype": "bfloat16", "cell": "decode equal"}]
    text = bm.markdown(rows, bm.versions())
    assert "transformers" in text.splitlines()[0] and "| p | f | l | bfloat16 | decode equal |" in text
