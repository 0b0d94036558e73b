"""Every checkpoint source open_checkpoint returns implements ckptq.io.source.CheckpointSource."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptq
from ckptq.checkpoint import CheckpointView, open_checkpoint
from ckptq.io.safetensors import SafetensorsView
from ckptq.io.source import CheckpointSource
from ckptq.io.torchsave import TorchSaveView

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(32, 64, generator=g), "b": torch.randn(64, generator=g)}


def test_each_source_implements_the_protocol(tmp_path):
    from safetensors.torch import save_file

    sd = _state()
    dcp.save(
        {"w": ckptq.quantize(sd["w"], "mxfp8"), "b": sd["b"]},
        checkpoint_id=tmp_path / "dcp",
        planner=ckptq.QuantizedSavePlanner(),
        no_dist=True,
    )
    torch.save(sd, tmp_path / "model.pt")
    save_file(sd, str(tmp_path / "model.safetensors"))
    views = {
        CheckpointView: open_checkpoint(tmp_path / "dcp"),
        TorchSaveView: open_checkpoint(tmp_path / "model.pt"),
        SafetensorsView: open_checkpoint(tmp_path / "model.safetensors"),
    }
    for cls, view in views.items():
        assert type(view) is cls
        assert isinstance(view, CheckpointSource)
        assert [e.fqn for e in view.entries()] == ["b", "w"]
        assert torch.equal(view.read("b"), sd["b"])
        assert view.files and isinstance(view.source, str)
        view.close()
    assert views[CheckpointView].source == "dcp"
    assert views[CheckpointView].saved_chunks("b") is not None
    assert views[TorchSaveView].saved_chunks("b") is None and views[SafetensorsView].saved_chunks("b") is None
