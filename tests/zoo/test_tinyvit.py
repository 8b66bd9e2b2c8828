"""The locally pretrained tiny ViT: smoke build in a temporary cache, cache reuse, a new head, damage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankwise.core.errors import ArtifactError
from rankwise.zoo import DATASETS, digits_task, pretrained_vit, tiny_vit_info, tiny_vit_path
from rankwise.zoo import tinyvit


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_smoke_build_cache_and_head(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert tiny_vit_info("smoke", build=False) is None
    model = pretrained_vit("smoke")
    path = tiny_vit_path("smoke")
    assert path.parent.parent == cache and path.is_dir()
    record = tiny_vit_info("smoke", build=False)
    assert record["metrics"]["source_task"] == "digits0to4" and 0.0 <= record["metrics"]["source_test_accuracy"] <= 1
    assert model.config.num_labels == 5 and model.config.image_size == 16
    # the second call loads from the cache: no training
    monkeypatch.setattr(tinyvit, "_train", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rebuilt")))
    again = pretrained_vit("smoke")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    ten = pretrained_vit("smoke", num_labels=10, seed=3)
    assert ten.classifier.out_features == 10 and ten(pixel_values=torch.rand(2, 1, 16, 16)).logits.shape == (2, 10)
    assert torch.equal(ten.vit.embeddings.cls_token, model.vit.embeddings.cls_token)
    (path / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="incomplete"):
        pretrained_vit("smoke")
    with pytest.raises(ValueError, match="tiny_vit size"):
        tiny_vit_path("huge")
    assert "tiny-vit-digits" in DATASETS


@pytest.mark.parametrize("name", ["digits5to9", "rot90", "inverted"])
def test_vapt_target_tasks_at_16(name: str) -> None:
    task = digits_task(name, seed=0, image_size=16)
    assert task.x_train.shape[1:] == (1, 16, 16) and float(task.x_train.min()) >= 0 and float(task.x_train.max()) <= 1
    counts = torch.bincount(task.y_train)
    assert int(counts.min()) >= 30  # 30 shots per class are available
