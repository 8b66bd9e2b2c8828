"""core.steps.causal_lm_step: one clipped AdamW step on a causal LM, refusing non-finite losses."""

from __future__ import annotations

import pytest
import torch

from rankwise.core.errors import NumericalError
from rankwise.core.steps import causal_lm_step


def _tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return LlamaForCausalLM(cfg)


def _batch():
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, mask, labels


def test_step_returns_the_loss_and_equals_the_written_out_step() -> None:
    a, b = _tiny_lm(), _tiny_lm()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    ids, mask, labels = _batch()
    loss = causal_lm_step(a, oa, ids, mask, labels, step=0, grad_clip=0.5)
    ref = b(input_ids=ids, attention_mask=mask, labels=labels).loss
    ob.zero_grad(set_to_none=True)
    ref.backward()
    torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    ob.step()
    assert loss == pytest.approx(float(ref), abs=0) and loss > 0
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    again = causal_lm_step(a, oa, ids, mask, labels, step=1)
    assert again < loss  # the step trained


def test_non_finite_loss_changes_nothing() -> None:
    m = _tiny_lm()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in m.parameters()]
    with torch.no_grad():
        m.model.embed_tokens.weight[3] = float("nan")
    before[0] = m.model.embed_tokens.weight.detach().clone()
    ids, mask, labels = _batch()
    ids[0, 0] = 3
    with pytest.raises(NumericalError, match="my loop: non-finite loss at step 7"):
        causal_lm_step(m, opt, ids, mask, labels, step=7, who="my loop")
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q) or (torch.isnan(p) == torch.isnan(q)).all() and torch.equal(p.nan_to_num(), q.nan_to_num())
    assert all(p.grad is None for p in m.parameters())
    assert isinstance(NumericalError("x"), FloatingPointError)  # agentvocab's callers catch FloatingPointError
