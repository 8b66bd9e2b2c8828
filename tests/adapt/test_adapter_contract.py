"""The adapter contract, run for every entry of ``contract.ADAPTERS`` on every tiny model it supports.

Each test states one promise of the adapt-family contract (DESIGN.md, "The method contract"):
shapes preserved, identity at initialisation, merge/unmerge equivalence, bit-exact save/load,
disable gives the base model, several named adapters, bad sizes rejected without touching the model.
"""

from __future__ import annotations

import pytest
import torch

import rankwise_tests_adapt_contract as contract  # registered by conftest.py
from rankwise.core.errors import ArtifactError, RankwiseError


def _snapshot(model: torch.nn.Module) -> dict:
    return {"types": [(n, type(m)) for n, m in model.named_modules()],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grad": {n: p.requires_grad for n, p in model.named_parameters()}}


def _assert_unchanged(model: torch.nn.Module, snap: dict) -> None:
    now = _snapshot(model)
    assert now["types"] == snap["types"], "module structure changed"
    assert now["grad"] == snap["grad"], "requires_grad flags changed"
    assert now["state"].keys() == snap["state"].keys()
    for k, v in snap["state"].items():
        assert torch.equal(now["state"][k], v), f"tensor {k} changed"


def _skip_unless(flag: bool, what: str, case) -> None:
    if not flag:
        pytest.skip(f"{case.name} does not support {what}")


def test_forward_shape_preserved(adapter_case, model_kind):
    base = contract.tiny_model(model_kind)
    y0 = contract.forward(base, model_kind)
    model = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 0)
    adapter_case.perturb(model, 1)
    y = contract.forward(model, model_kind)
    assert y.shape == y0.shape and y.dtype == y0.dtype
    assert torch.isfinite(y).all()
    assert not torch.allclose(y, y0, atol=1e-6), "a trained adapter should change the outputs"


def test_base_frozen_adapter_trainable(adapter_case, model_kind):
    _skip_unless(adapter_case.freezes_base, "frozen base weights", adapter_case)
    model = contract.tiny_model(model_kind)
    base_ids = {id(p) for p in model.parameters()}
    adapter_case.apply(model, model_kind, "default", 0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable, "the adapter has no trainable parameters"
    assert not any(p.requires_grad for p in model.parameters() if id(p) in base_ids)
    # gradients reach the adapter only
    out = model(contract.inputs(model_kind))
    y = out if isinstance(out, torch.Tensor) else out.last_hidden_state
    y.square().mean().backward()
    assert all(p.grad is None for p in model.parameters() if id(p) in base_ids)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


def test_identity_at_init(adapter_case, model_kind):
    _skip_unless(adapter_case.identity_at_init, "identity at initialisation", adapter_case)
    y0 = contract.forward(contract.tiny_model(model_kind), model_kind)
    model = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 0)
    torch.testing.assert_close(contract.forward(model, model_kind), y0, atol=1e-6, rtol=0)


def test_merge_unmerge_equivalence(adapter_case, model_kind):
    _skip_unless(adapter_case.supports_merge, "merge/unmerge", adapter_case)
    model = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 0)
    adapter_case.perturb(model, 1)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    y = contract.forward(model, model_kind)
    adapter_case.merge(model)
    torch.testing.assert_close(contract.forward(model, model_kind), y, atol=adapter_case.merge_atol, rtol=0)
    with pytest.raises(RankwiseError):
        adapter_case.merge(model)
    adapter_case.unmerge(model)
    torch.testing.assert_close(contract.forward(model, model_kind), y, atol=adapter_case.merge_atol, rtol=0)
    for n, p in model.named_parameters():
        if n in frozen:
            torch.testing.assert_close(p.detach(), frozen[n], atol=1e-6, rtol=0)


def test_save_load_roundtrip_bit_exact(adapter_case, model_kind, tmp_path):
    _skip_unless(adapter_case.supports_save, "save/load", adapter_case)
    model = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 0)
    adapter_case.perturb(model, 1)
    adapter_case.save(model, tmp_path / "adapter", "default")
    other = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 7)
    adapter_case.load(other, tmp_path / "adapter", "default")
    a, b = model.state_dict(), other.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert torch.equal(contract.forward(model, model_kind), contract.forward(other, model_kind))


def test_load_rejects_corrupt_file_and_keeps_model(adapter_case, model_kind, tmp_path):
    _skip_unless(adapter_case.supports_save, "save/load", adapter_case)
    model = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 0)
    adapter_case.perturb(model, 1)
    adapter_case.save(model, tmp_path / "adapter", "default")
    biggest = max((p for p in (tmp_path / "adapter").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte near the end of the payload
    biggest.write_bytes(bytes(data))
    other = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 7)
    snap = _snapshot(other)
    with pytest.raises(ArtifactError):
        adapter_case.load(other, tmp_path / "adapter", "default")
    _assert_unchanged(other, snap)
    biggest.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(ArtifactError):
        adapter_case.load(other, tmp_path / "adapter", "default")
    _assert_unchanged(other, snap)


def test_load_rejects_other_base_model(adapter_case, model_kind, tmp_path):
    _skip_unless(adapter_case.supports_save and adapter_case.checks_base, "base-model checks on load",
                 adapter_case)
    model = adapter_case.apply(contract.tiny_model(model_kind, seed=0), model_kind, "default", 0)
    adapter_case.perturb(model, 1)
    adapter_case.save(model, tmp_path / "adapter", "default")
    other = adapter_case.apply(contract.tiny_model(model_kind, seed=1), model_kind, "default", 0)
    snap = _snapshot(other)
    with pytest.raises(ArtifactError, match="different base model"):
        adapter_case.load(other, tmp_path / "adapter", "default")
    _assert_unchanged(other, snap)


def test_disable_gives_base_outputs(adapter_case, model_kind):
    _skip_unless(adapter_case.supports_disable, "disable/enable", adapter_case)
    y0 = contract.forward(contract.tiny_model(model_kind), model_kind)
    model = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "default", 0)
    adapter_case.perturb(model, 1)
    y = contract.forward(model, model_kind)
    adapter_case.disable(model)
    torch.testing.assert_close(contract.forward(model, model_kind), y0, atol=1e-6, rtol=0)
    adapter_case.enable(model)
    torch.testing.assert_close(contract.forward(model, model_kind), y, atol=0, rtol=0)


def test_several_named_adapters(adapter_case, model_kind):
    _skip_unless(adapter_case.supports_multiple, "several named adapters", adapter_case)
    model = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "first", 1)
    adapter_case.perturb(model, 11)
    y_first = contract.forward(model, model_kind)
    adapter_case.apply(model, model_kind, "second", 2)
    adapter_case.perturb(model, 22)
    y_second = contract.forward(model, model_kind)
    assert not torch.allclose(y_first, y_second, atol=1e-6)
    adapter_case.set_active(model, "first")
    torch.testing.assert_close(contract.forward(model, model_kind), y_first, atol=0, rtol=0)
    adapter_case.set_active(model, "second")
    torch.testing.assert_close(contract.forward(model, model_kind), y_second, atol=0, rtol=0)
    # the second adapter alone, on a fresh model, gives the same outputs
    alone = adapter_case.apply(contract.tiny_model(model_kind), model_kind, "second", 2)
    adapter_case.perturb(alone, 22)
    torch.testing.assert_close(contract.forward(alone, model_kind), y_second, atol=1e-6, rtol=0)


def test_bad_rank_rejected_model_unchanged(adapter_case, model_kind):
    _skip_unless(adapter_case.bad_rank is not None, "a bad-rank check", adapter_case)
    model = contract.tiny_model(model_kind)
    snap = _snapshot(model)
    with pytest.raises(ValueError):
        adapter_case.bad_rank(model, model_kind)
    _assert_unchanged(model, snap)
    # also on a model that already holds an adapter
    adapter_case.apply(model, model_kind, "default", 0)
    snap = _snapshot(model)
    with pytest.raises(ValueError):
        adapter_case.bad_rank(model, model_kind)
    _assert_unchanged(model, snap)
