"""repro.ctm internals: the evaluator applies an adapter exactly like LoRA surgery; references are exact."""

from __future__ import annotations

import pytest
import torch

from rankwise import zoo
from rankwise.core.lora import set_state
from rankwise.merge import baselines
from rankwise.repro.ctm import SMOKE_RECIPE, Evaluator, _full_rank_state
from rankwise.repro.kit.cached_encoder import FrozenPrefix, pooled_cached
from rankwise.repro.kit.task_loras import encode_task, task_data, task_lora, top_model


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


def test_quick_task_rule_picks_passing_tasks_cheapest_first():
    from rankwise.repro.ctm import quick_task_rule

    gains = {"a": [3.0, 2.0], "b": [10.0, -1.0], "c": [1.0, 2.0], "d": [2.0, 2.0], "e": [5.0, 5.0]}
    n = {"a": 500, "b": 100, "c": 10, "d": 300, "e": 300}
    assert quick_task_rule(gains, n) == ("b", "d", "e")  # c fails (mean 1.5); ties in cost by name
    with pytest.raises(ValueError, match="only 2 tasks"):
        quick_task_rule({"a": [3.0, 3.0], "b": [0.0, 0.0], "c": [2.5, 2.5]}, {"a": 1, "b": 1, "c": 1}, min_gain=2.5)


@pytest.mark.slow
def test_quick_tasks_follow_the_validation_rule():
    """QUICK_TASKS = the rule applied to the recipe's LoRAs (seeds 0, 1; validation only). Trains and caches
    the 12 LoRAs of TASKS on first use (about 80 s of one-thread CPU); fails if a recipe or corpus change
    moved the choice, which must then be redone (and the documented table updated)."""
    from rankwise.repro.ctm import QUICK_TASKS, quick_task_rule
    from rankwise.repro.kit.task_loras import RECIPE, TASKS, shared_encodings

    bert, tok = zoo.minilm()
    gains: dict[str, list[float]] = {t: [] for t in TASKS}
    n_train = {}
    with shared_encodings():
        for seed in (0, 1):
            for t in TASKS:
                tl = task_lora(t, seed, bert=bert, tokenizer=tok)
                ev = Evaluator(bert, tok, [tl], [task_data(t, seed)], RECIPE)
                assert ev.accuracies(tl.state, "val")[0] == pytest.approx(tl.metrics["val_acc"])
                gains[t].append(100 * (tl.metrics["val_acc"] - ev.accuracies(None, "val")[0]))
                n_train[t] = tl.metrics["n_train"]
    assert set(quick_task_rule(gains, n_train)) == set(QUICK_TASKS)


def test_weighted_hits_average_to_the_normalized_accuracy():
    """Claim (1)'s paired samples: per-example weights make their mean the normalized accuracy in points."""
    import statistics

    from rankwise.repro.ctm import _norm_acc, _weighted_hits

    hits = [torch.tensor([True, False, True, True]), torch.tensor([False, True])]
    ref = [0.8, 0.6]
    accs = [float(h.double().mean()) for h in hits]
    assert statistics.fmean(_weighted_hits(hits, ref)) == pytest.approx(100 * _norm_acc(accs, ref), rel=1e-12)
    other = [torch.tensor([True, True, True, True]), torch.tensor([False, False])]
    diff = [a - b for a, b in zip(_weighted_hits(hits, ref), _weighted_hits(other, ref))]
    acc_o = [float(h.double().mean()) for h in other]
    assert statistics.fmean(diff) == pytest.approx(100 * (_norm_acc(accs, ref) - _norm_acc(acc_o, ref)), rel=1e-12)
