"""PEFT interop both ways on a tiny BERT: rankwise -> PeftModel.from_pretrained and PEFT save_pretrained -> rankwise.

Outputs must agree within 1e-5 (max abs); factors must survive a round trip bit-exactly; PEFT
features that are not standard LoRA on nn.Linear must be refused with a clear error.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import rankwise_tests_adapt_contract as contract  # registered by conftest.py
from rankwise.adapt import lora
from rankwise.adapt.lora import LoraConfig
from rankwise.core.errors import ArtifactError
from rankwise.core.lora import add_lora

peft = pytest.importorskip("peft")
TOL = 1e-5


def _bert(seed: int = 0):
    return contract.tiny_model("bert", seed)


def _out(model) -> torch.Tensor:
    with torch.no_grad():
        return model(contract.inputs("bert")).last_hidden_state


def _peft_load(directory, seed: int = 0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(_bert(seed), str(directory)).eval()


def _peft_model(**cfg):
    base = _bert()
    torch.manual_seed(123)  # PEFT draws its (non-zero, init_lora_weights=False) factors from the global RNG
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **cfg)).eval()


def test_export_loads_in_peft_with_identical_outputs(tmp_path):
    model = lora.adapt(_bert(), LoraConfig(rank=4, alpha=8))
    contract.perturb_trainable(model, 1)
    d = lora.export_peft(model, tmp_path / "peft", base_model_name_or_path="tiny-bert")
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["base_model_name_or_path"] == "tiny-bert" and cfg["rank_pattern"] == {}
    pm = _peft_load(d)
    assert (_out(pm) - _out(model)).abs().max().item() <= TOL
    # the adapter really is in use on the PEFT side
    with pm.disable_adapter():
        assert (_out(pm) - _out(_bert())).abs().max().item() <= TOL
    assert (_out(pm) - _out(_bert())).abs().max().item() > 1e-3


def test_export_rslora_per_module_ranks_and_named_adapter(tmp_path):
    model = _bert()
    add_lora(model, ("query", "key", "value", "dense"), "task2",
             rank=lambda n, m: 2 if "key" in n else (6 if "intermediate" in n else 4),
             alpha=lambda n, m: 3.0 if "value" in n else 8.0, use_rslora=True)
    contract.perturb_trainable(model, 2)
    d = lora.export_peft(model, tmp_path / "peft", name="task2")
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is True and cfg["r"] == 4 and cfg["rank_pattern"] and cfg["alpha_pattern"]
    pm = _peft_load(d)
    assert (_out(pm) - _out(model)).abs().max().item() <= TOL
    # and back: PEFT's own save of what it loaded reads back bit-exactly
    pm.save_pretrained(str(tmp_path / "resaved"))
    back = lora.import_peft(tmp_path / "resaved", model=_bert())
    ours = lora.get_state(model, "task2")
    assert back.modules() == ours.modules() or sorted(back.modules()) == sorted(ours.modules())
    for m in ours.modules():
        for k in ("lora_A", "lora_B"):
            assert torch.equal(back.factors[m][k], ours.factors[m][k]), (m, k)
        assert back.scaling[m] == pytest.approx(ours.scaling[m], rel=1e-12)


def _seq(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()),
                               torch.nn.Sequential(torch.nn.Linear(16, 8))).eval()


@pytest.mark.parametrize("targets, ranks, regex_target, anchored", [
    (["0", "1.0", "2.0"], {"0": 3, "1.0": 2, "2.0": 2}, False, True),  # rank_pattern key "0" must not hit "1.0"
    (["0", "2.0"], {"0": 2, "2.0": 3}, True, False),  # a target list ["0", ...] would also pick "1.0"
])
def test_export_ambiguous_module_names(tmp_path, targets, ranks, regex_target, anchored):
    model = _seq()
    add_lora(model, lambda name, module: name in targets, rank=ranks)  # exact names
    contract.perturb_trainable(model, 3)
    d = lora.export_peft(model, tmp_path / "peft")
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert isinstance(cfg["target_modules"], str) == regex_target
    assert any(k.startswith("^") for k in cfg["rank_pattern"]) == anchored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(_seq(), str(d)).eval()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (pm(x) - model(x)).abs().max().item() <= TOL
    wrapped = sorted(n.removeprefix("base_model.model.") for n, m in pm.named_modules()
                     if isinstance(m, peft.tuners.lora.LoraLayer))
    assert wrapped == sorted(targets)
    assert {n.removeprefix("base_model.model."): m.r["default"] for n, m in pm.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)} == ranks


def test_peft_saved_adapter_loads_into_rankwise(tmp_path):
    pm = _peft_model(r=4, lora_alpha=12, target_modules=["query", "key", "value", "dense"])
    pm.save_pretrained(str(tmp_path / "p"))
    y_peft = _out(pm)
    model = lora.load_peft(_bert(), tmp_path / "p")
    assert (_out(model) - y_peft).abs().max().item() <= TOL
    state = lora.import_peft(tmp_path / "p")
    assert state.fingerprint is None and state.config["source"] == "peft"
    assert set(state.ranks().values()) == {4} and set(state.scaling.values()) == {3.0}
    assert len(state.modules()) == 2 * 6 + 1  # q, k, v, 3 dense per layer, + pooler.dense
    # bit-exact factors
    sd = peft.get_peft_model_state_dict(pm)
    for m in state.modules():
        assert torch.equal(state.factors[m]["lora_A"], sd[f"base_model.model.{m}.lora_A.weight"])
    # rankwise -> save -> load round trip of what came from PEFT
    lora.save_adapter(model, tmp_path / "rw")
    again = lora.load_adapter(_bert(), tmp_path / "rw")
    assert torch.equal(_out(again), _out(model))


def test_peft_rslora_and_patterns_load_into_rankwise(tmp_path):
    pm = _peft_model(r=4, lora_alpha=8, use_rslora=True, target_modules=["query", "value"],
                     rank_pattern={"encoder.layer.1.attention.self.query": 2}, alpha_pattern={"value": 5})
    pm.save_pretrained(str(tmp_path / "p"))
    model = lora.load_peft(_bert(), tmp_path / "p", name="imported")
    assert lora.adapter_names(model) == ["imported"]
    assert (_out(model) - _out(pm)).abs().max().item() <= TOL
    state = lora.get_state(model, "imported")
    assert state.rank("encoder.layer.1.attention.self.query") == 2
    assert state.scaling["encoder.layer.0.attention.self.value"] == pytest.approx(5 / 2)


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unsupported_peft_features_rejected(tmp_path):
    pm = _peft_model(r=2, lora_alpha=4, target_modules=["query"], use_dora=True)
    pm.save_pretrained(str(tmp_path / "dora"))
    with pytest.raises(ArtifactError, match="DoRA"):
        lora.import_peft(tmp_path / "dora")
    _edit_config(tmp_path / "dora", use_dora=False)  # config lies: the tensors still give it away
    with pytest.raises(ArtifactError, match="DoRA magnitude"):
        lora.import_peft(tmp_path / "dora")

    pm = _peft_model(r=2, lora_alpha=4, target_modules=["word_embeddings", "query"])
    pm.save_pretrained(str(tmp_path / "emb"))
    with pytest.raises(ArtifactError, match="nn.Embedding"):
        lora.import_peft(tmp_path / "emb")

    pm = _peft_model(r=2, lora_alpha=4, target_modules=["query"])
    pm.save_pretrained(str(tmp_path / "ok"))
    for change, msg in [({"bias": "all"}, "bias='all'"), ({"modules_to_save": ["pooler"]}, "modules_to_save"),
                        ({"init_lora_weights": "pissa"}, "pissa"), ({"fan_in_fan_out": True}, "fan_in_fan_out"),
                        ({"peft_type": "LOHA"}, "unsupported PEFT type 'LOHA'")]:
        d = tmp_path / f"edit_{len(msg)}_{list(change)[0]}"
        d.mkdir()
        for f in (tmp_path / "ok").iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        _edit_config(d, **change)
        with pytest.raises(ArtifactError, match=msg):
            lora.import_peft(d)


def test_peft_pickle_and_missing_files_rejected(tmp_path):
    pm = _peft_model(r=2, lora_alpha=4, target_modules=["query"])
    pm.save_pretrained(str(tmp_path / "p"))
    (tmp_path / "p" / "adapter_model.safetensors").rename(tmp_path / "p" / "adapter_model.bin")
    with pytest.raises(ArtifactError, match="never loads"):
        lora.import_peft(tmp_path / "p")
    (tmp_path / "p" / "adapter_config.json").unlink()
    with pytest.raises(ArtifactError, match="no adapter_config.json"):
        lora.import_peft(tmp_path / "p")


def test_peft_adapter_for_other_shapes_rejected(tmp_path):
    pm = _peft_model(r=2, lora_alpha=4, target_modules=["query"])
    pm.save_pretrained(str(tmp_path / "p"))
    wider = contract.tiny_model("bert", hidden=48)
    snap = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(ArtifactError, match=r"\(out=32, in=32\), the layer is \(out=48, in=48\)"):
        lora.load_peft(wider, tmp_path / "p")
    assert wider.state_dict().keys() == snap.keys()
    mlp = contract.tiny_model("mlp")
    with pytest.raises(ArtifactError, match="does not exist in the model"):
        lora.load_peft(mlp, tmp_path / "p")
