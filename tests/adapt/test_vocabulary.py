"""One vocabulary across adapters: ``rank``, ``calib=`` / ``calib_batches``, ``unload(merge=...)``.

The names of earlier releases (``r``, ``lora_rank``, ``base_rank``, ``lora_alpha``, ``analysis_batches``,
``n_calib_batches``, ``batches=``, ``merge_first=``) keep working for one release, each with a
DeprecationWarning; giving the old and the new name together is an error; artefacts saved with the old
field names still load.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from rankwise.adapt import cdka, daf, e2lora, lora, lora_mixer, mtlora, psoft
from rankwise.core import io


@pytest.mark.parametrize("cls,old,new,value", [
    (psoft.PSOFTConfig, "r", "rank", 4),
    (e2lora.E2LoRAConfig, "base_rank", "rank", 4),
    (e2lora.E2LoRAConfig, "n_calib_batches", "calib_batches", 2),
    (daf.DAFConfig, "lora_rank", "rank", 4),
    (daf.DAFConfig, "lora_alpha", "alpha", 8.0),
    (daf.DAFConfig, "analysis_batches", "calib_batches", 2),
])
def test_old_config_field_names_are_deprecated_aliases(cls, old, new, value):
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated, use '{new}'"):
        cfg = cls(**{old: value})
    assert getattr(cfg, new) == value
    assert cfg == cls(**{new: value})
    assert old not in {f.name for f in dataclasses.fields(cls)}  # asdict / saved configs use the new name
    with pytest.warns(DeprecationWarning):
        assert getattr(cfg, old) == value
    with pytest.raises(TypeError, match="both"):
        cls(**{old: value, new: value})


def test_every_config_uses_rank():
    for cls in (lora.LoraConfig, psoft.PSOFTConfig, e2lora.E2LoRAConfig, daf.DAFConfig, mtlora.MtLoRAConfig,
                lora_mixer.LoRAMixerConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        assert "rank" in names and not names & {"r", "lora_rank", "base_rank"}, cls.__name__
    for cls in (cdka.CDKAConfig, e2lora.E2LoRAConfig, daf.DAFConfig):
        assert "calib_batches" in {f.name for f in dataclasses.fields(cls)}, cls.__name__


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(2)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def test_daf_adapt_batches_is_a_deprecated_alias_of_calib():
    cfg = daf.DAFConfig(rank=2, calib_batches=1, budget_fraction=1.0)
    with pytest.warns(DeprecationWarning, match="'batches' is deprecated, use 'calib'"):
        a = daf.adapt(_mlp(), cfg, target=nn.Linear, batches=_batches(), loss_fn=_loss)
    b = daf.adapt(_mlp(), cfg, target=nn.Linear, calib=_batches(), loss_fn=_loss)
    assert torch.equal(a(_batches()[0]), b(_batches()[0]))


def test_allocate_ranks_base_rank_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="base_rank"):
        old = e2lora.allocate_ranks([1.0, 2.0], [[0], [1]], base_rank=4)
    assert old == e2lora.allocate_ranks([1.0, 2.0], [[0], [1]], rank=4)


@pytest.mark.parametrize("module", [cdka, psoft, lora])
def test_unload_merge_first_is_a_deprecated_alias_of_merge(module):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    models = []
    for kw in ({"merge": False}, {"merge_first": False}):
        model = _mlp()
        if module is cdka:
            module.adapt(model, cdka.CDKAConfig(config_mode="fixed", r1=1, r2=1, r=2, init="zero"), target=nn.Linear)
        elif module is psoft:
            module.adapt(model, psoft.PSOFTConfig(rank=2), target=nn.Linear)
        else:
            module.adapt(model, lora.LoraConfig(rank=2), target=nn.Linear)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.1)
        if "merge_first" in kw:
            with pytest.warns(DeprecationWarning, match="merge_first"):
                module.unload(model, **kw)
        else:
            module.unload(model, **kw)
        models.append(model)
    assert all(isinstance(m, nn.Linear) for m in (models[0][0], models[1][0]))
    assert torch.equal(models[0](x), models[1](x))  # not merged: both give the base model back


def test_daf_artefact_with_old_field_names_still_loads(tmp_path):
    cfg = daf.DAFConfig(rank=2, alpha=4.0, calib_batches=1, budget_fraction=1.0)
    model = daf.adapt(_mlp(), cfg, target=nn.Linear, calib=_batches(), loss_fn=_loss)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05)
    daf.save_adapter(model, tmp_path / "new")
    # rewrite the artefact as an earlier release wrote it: lora_rank / lora_alpha / analysis_batches
    tensors, meta = io.load_tensors(tmp_path / "new" / daf.WEIGHTS_FILE)
    old = {"lora_rank": "rank", "lora_alpha": "alpha", "analysis_batches": "calib_batches"}
    meta["config"] = {next((o for o, n in old.items() if n == k), k): v for k, v in meta["config"].items()}
    assert "lora_rank" in meta["config"] and "rank" not in meta["config"]
    (tmp_path / "old").mkdir()
    io.save_tensors(tmp_path / "old" / daf.WEIGHTS_FILE, tensors, meta)
    fresh = daf.adapt(_mlp(), cfg, target=nn.Linear, calib=_batches(), loss_fn=_loss)
    daf.load_adapter(fresh, tmp_path / "old")
    x = _batches()[1]
    assert torch.equal(fresh(x), model(x))
    assert [r["cost"] for r in daf.report(fresh)] == [r["cost"] for r in daf.report(model)]
