"""One-shot safety patch: the spec's correctness checks and bad inputs, on a tiny random Llama."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from rankwise.core.errors import ArtifactError, NumericalError
from rankwise.train.safety_one_shot import (
    MultiExampleSafetyPatch,
    OneShotSafetyPatch,
    SafetyPatchConfig,
    apply_delta,
    energy_ratios,
    gradient_antagonism,
    load_delta,
    matrix_parameters,
    project_update,
    safety_gradient,
    safety_gradient_spectrum,
    top_subspaces,
)
from rankwise.zoo.synthetic import SafetyWorld

EX = {"prompt": "req h_01 h_02 h_03 : 3 4", "response": " REFUSE"}


@pytest.fixture(scope="module")
def world_tok():
    w = SafetyWorld()
    return w, w.tokenizer()


@pytest.fixture()
def model(world_tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = world_tok
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


def _logits(m, tok, text=EX["prompt"] + EX["response"]):
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return m(input_ids=ids).logits


def _cfg(**kw):
    return SafetyPatchConfig(**{"epochs": 3, "lr": 1e-2, "stop_nll": None, **kw})


def test_epochs_zero_is_identity_and_original_untouched(model, world_tok):
    _, tok = world_tok
    ref = copy.deepcopy(model.state_dict())
    p = OneShotSafetyPatch(model, tok, _cfg(epochs=0))
    out = p.patch(EX)
    assert out is not model
    assert all(torch.equal(out.state_dict()[k], v) for k, v in ref.items())
    assert p.result.steps == 0 and len(p.result.losses) == 1
    p2 = OneShotSafetyPatch(model, tok, _cfg())
    out2 = p2.patch(EX)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())  # inplace=False leaves it
    assert any(not torch.equal(out2.state_dict()[k], v) for k, v in ref.items())


def test_frozen_parameters_are_byte_identical(model, world_tok):
    _, tok = world_tok
    for n, prm in model.named_parameters():
        if "layers.0.self_attn" in n or "embed" in n:
            prm.requires_grad_(False)
    frozen = {n: prm.detach().clone() for n, prm in model.named_parameters() if not prm.requires_grad}
    p = OneShotSafetyPatch(model, tok, _cfg())
    out = p.patch(EX)
    got = dict(out.named_parameters())
    assert all(torch.equal(got[n], v) for n, v in frozen.items())
    assert set(p.delta) == {n for n, prm in model.named_parameters() if prm.requires_grad}


def test_full_rank_projection_equals_plain_update(model, world_tok):
    _, tok = world_tok
    plain = OneShotSafetyPatch(model, tok, _cfg()).patch(EX)
    with pytest.warns(UserWarning, match="exceeds min"):
        full = OneShotSafetyPatch(model, tok, _cfg(projection_rank=10_000)).patch(EX)
    for (n, a), (_, b) in zip(plain.named_parameters(), full.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), n


def test_projected_update_lies_in_the_safety_subspace(model, world_tok):
    _, tok = world_tok
    k = 2
    subs = top_subspaces(safety_gradient(model, tok, EX), k)
    p = OneShotSafetyPatch(model, tok, _cfg(projection_rank=k))
    p.patch(EX)
    for n, (U, V) in subs.items():
        d = p.delta[n]
        assert float((d - U.double() @ (U.double().T @ d)).abs().max()) < 1e-6, n
        assert float((d - (d @ V.double()) @ V.double().T).abs().max()) < 1e-6, n
    # the pure function: idempotent, and the identity at full rank
    dW = torch.randn(6, 4, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(torch.randn(6, 4, dtype=torch.float64), full_matrices=True)
    assert torch.allclose(project_update(dW, U, Vh.T), dW)  # full bases on both sides: the identity
    assert torch.equal(project_update(dW, None, None), dW)
    P1 = project_update(dW, U[:, :2], Vh[:2].T)
    assert torch.allclose(project_update(P1, U[:, :2], Vh[:2].T), P1)


def test_energy_monotone_and_effective_rank_bounds(model, world_tok):
    _, tok = world_tok
    spec = safety_gradient_spectrum(model, tok, EX, ks=(1, 2, 4, 8, 16, 64))
    assert spec.n_target_tokens == 2  # REFUSE + EOS
    for n, sp in spec.layers.items():
        vals = [sp.energy[k] for k in (1, 2, 4, 8, 16, 64)]
        assert all(a <= b + 1e-12 for a, b in zip(vals, vals[1:])), n
        assert abs(energy_ratios(sp.singular_values, [min(sp.shape)])[min(sp.shape)] - 1.0) < 1e-9
        assert sp.effective_rank <= spec.n_positions + 1e-9, n  # rank(G) <= sequence length
    # the output layer's gradient is a sum over target positions only
    assert spec["lm_head.weight"].effective_rank <= spec.n_target_tokens + 1e-9
    assert 0.0 <= spec.share_low_rank(8) <= 1.0


def test_nll_decreases_monotonically_at_small_lr(model, world_tok):
    _, tok = world_tok
    p = OneShotSafetyPatch(model, tok, _cfg(epochs=8, lr=1e-4))
    p.patch(EX)
    ls = p.result.losses
    assert len(ls) == 9 and all(b < a for a, b in zip(ls, ls[1:])), ls


def test_early_stop(model, world_tok):
    _, tok = world_tok
    p = OneShotSafetyPatch(model, tok, SafetyPatchConfig(epochs=50, lr=3e-2, stop_nll=0.5))
    p.patch(EX)
    assert p.result.stopped_early and p.result.final_nll < 0.5 and p.result.steps < 50


def test_saved_delta_reproduces_patched_logits(model, world_tok, tmp_path):
    _, tok = world_tok
    p = OneShotSafetyPatch(model, tok, _cfg())
    patched = p.patch(EX)
    path = p.save(tmp_path / "patch.safetensors")
    tensors, meta = load_delta(path)
    assert meta["examples"] == [EX] and meta["steps"] == 3
    again = apply_delta(copy.deepcopy(model), path)
    assert torch.equal(_logits(again, tok), _logits(patched, tok))
    with pytest.raises(ArtifactError, match="different base model"):
        apply_delta(copy.deepcopy(patched), path)


def test_selection_rules(model, world_tok):
    w, tok = world_tok
    cands = w.harmful(5, 3, "refuse")
    aligned = copy.deepcopy(model)
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(0.01 * torch.randn_like(prm))
    p = OneShotSafetyPatch(model, tok, _cfg())
    pick = p.select_example(cands, reference_state=aligned.state_dict())
    assert pick is cands[max(range(5), key=p.selection_scores.__getitem__)]
    assert all(-1.0 <= s <= 1.0 for s in p.selection_scores)
    r1 = p.select_example(cands, rule="random", seed=4)
    assert r1 is p.select_example(cands, rule="random", seed=4)
    # antagonism of the whole harmful shift with the gradient, per layer and overall
    delta = {n: prm.detach() - aligned.state_dict()[n] for n, prm in matrix_parameters(model).items()}
    cos, per = gradient_antagonism(safety_gradient(model, tok, cands[0]), delta)
    assert -1 <= cos <= 1 and set(per) == set(delta)


def test_multi_example_with_one_example_equals_one_shot(model, world_tok):
    w, tok = world_tok
    a = OneShotSafetyPatch(model, tok, _cfg()).patch(EX)
    b = MultiExampleSafetyPatch(model, tok, _cfg()).patch([EX])
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    m = MultiExampleSafetyPatch(model, tok, _cfg(epochs=2), batch_size=2)
    m.patch(w.harmful(5, 1, "refuse"))
    assert m.result.steps == 6 and m.result.n_examples == 5


# -- bad inputs ------------------------------------------------------------------------------------


def test_bad_inputs(model, world_tok):
    w, tok = world_tok
    p = OneShotSafetyPatch(model, tok, _cfg())
    with pytest.raises(ValueError, match="empty response"):
        p.patch({"prompt": "req h_01 h_02 h_03 : 1 2", "response": "  "})
    with pytest.raises(ValueError, match="MultiExampleSafetyPatch"):
        p.patch([EX, EX])
    with pytest.raises(ValueError, match="projection_rank"):
        SafetyPatchConfig(projection_rank=0)
    with pytest.raises(ValueError, match="epochs"):
        SafetyPatchConfig(epochs=-1)
    with pytest.raises(ValueError, match="needs the keys"):
        p.patch({"question": "x"})
    with pytest.raises(ValueError, match="projection rank"):
        top_subspaces({"w": torch.ones(3, 3)}, -1)
    bad = dict(model.state_dict())
    bad.pop("lm_head.weight")
    bad["extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"missing keys: lm_head.weight.*unexpected keys: extra.weight"):
        p.select_example(w.harmful(3, 0, "refuse"), reference_state=bad)
    with pytest.raises(ValueError, match="reference_state"):
        p.select_example(w.harmful(3, 0, "refuse"))
    with pytest.raises(ValueError, match="shape mismatch"):
        p.select_example(w.harmful(3, 0, "refuse"),
                         reference_state={**model.state_dict(), "lm_head.weight": torch.zeros(2, 2)})


def test_nan_restores_the_pre_patch_weights(model, world_tok):
    _, tok = world_tok
    ref = {n: prm.detach().clone() for n, prm in model.named_parameters()}
    p = OneShotSafetyPatch(model, tok, SafetyPatchConfig(epochs=5, lr=1e38, stop_nll=None, optimizer="sgd"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NumericalError, match="restored"):
            p.patch(EX, inplace=True)
    assert all(torch.equal(prm, ref[n]) for n, prm in model.named_parameters())
