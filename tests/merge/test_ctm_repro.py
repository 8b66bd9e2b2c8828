"""repro.ctm internals: the evaluator applies an adapter exactly like LoRA surgery; references are exact."""

from __future__ import annotations

import pytest
import torch

from rankwise import zoo
from rankwise.core.lora import set_state
from rankwise.merge import baselines
from rankwise.repro.ctm import SMOKE_RECIPE, Evaluator, _full_rank_state
from rankwise.zoo.cached_encoder import FrozenPrefix, pooled_cached
from rankwise.zoo.task_loras import encode_task, task_data, task_lora, top_model


@pytest.fixture(scope="module")
def setup():
    bert, tok = zoo.minilm()
    tasks = ("kind", "topic")
    loras = [task_lora(t, 0, recipe=SMOKE_RECIPE, bert=bert, tokenizer=tok, cache=False) for t in tasks]
    datas = [task_data(t, 0, SMOKE_RECIPE) for t in tasks]
    return bert, tok, loras, datas


def test_evaluator_equals_lora_surgery(setup):
    bert, tok, loras, datas = setup
    memo: dict = {}
    ev = Evaluator(bert, tok, loras, datas, SMOKE_RECIPE, memo)
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - SMOKE_RECIPE["top_layers"], SMOKE_RECIPE["max_length"])
    state = loras[1].state
    model = top_model(bert, 2, 0, SMOKE_RECIPE)
    set_state(model, state, "default", check_base=False)
    got = ev.embeddings(state, "test")
    for d, e in zip(datas, got):  # every task, in its own example order
        h, m, _ = encode_task(prefix, d.test)
        assert torch.allclose(e, pooled_cached(model, h, m), atol=1e-4)
    base_model = top_model(bert, 2, 0, SMOKE_RECIPE)
    h, m, y = encode_task(prefix, datas[0].test)
    base = ev.embeddings(None, "test")[0]  # the adapter is removed again
    assert torch.allclose(base, pooled_cached(base_model, h, m), atol=1e-4)
    W, b = loras[0].head["weight"], loras[0].head["bias"]
    assert ev.accuracies(None, "test")[0] == pytest.approx(float(((base @ W.T + b).argmax(-1) == y).double().mean()))
    n = ev.evals
    Evaluator(bert, tok, loras, datas, SMOKE_RECIPE, memo).accuracies(None, "test")  # base embeddings memoised
    assert ev.evals == n and len(memo) == 1


def test_evaluator_rejects_foreign_modules(setup):
    bert, tok, loras, datas = setup
    ev = Evaluator(bert, tok, loras, datas, SMOKE_RECIPE)
    state = loras[0].state
    bad = type(state)(dict(state.config), {"layers.7.attention.self.query": state.factors[state.modules()[0]]},
                      {"layers.7.attention.self.query": 1.0})
    with pytest.raises(ValueError, match="layers.7"):
        ev.accuracies(bad, "val")


@pytest.mark.parametrize("rule", ["ta", "ties"])
def test_full_rank_reference_is_the_untruncated_merge(setup, rule):
    states = [tl.state for tl in setup[2]]
    ref = _full_rank_state(states, rule, 0.75, 0.3)
    deltas = baselines.merged_deltas(states, baselines.MergeConfig(rule=rule, scale=0.75, density=0.3), rank=None)
    for mod, d in deltas.items():
        assert torch.equal(ref.delta_weight(mod, torch.float64), d)
