"""AgentVocab: what the added tokens cost and save, side by side with the base tokenizer.

Set-up (once per size): the zoo's tiny LM (``small``: byte-level BPE of 2,048, Llama hidden 128 x 4 layers;
``smoke`` for the smoke run) with the hermes markers as tokens (T0); 1,000 seeded agent trajectories
(:mod:`rankwise.zoo.agent_traces`) rendered by the template; AgentVocab's mixed vocabulary (96 structural +
32 content tokens, frequency-ranked: no gradient model, so the set-up stays cheap) and continued BPE with the
same 128 merges.

* ``encode_corpus``: encoding the 1,000 rendered trajectories (batch call of the fast tokenizer). Anchor: T0;
  the added-token matcher runs before BPE, so the expanded tokenizer may cost more per character but
  produces fewer tokens.
* ``decode_call``: forced batch-1 decoding of 20 gold tool calls with the KV cache, one model step per token
  of the call under each tokenizer, after the prompt's prefill (the model with mean-initialised rows; the
  time depends on the tokenization, not on what the model predicts). Anchor: T0. This is the per-call
  latency the paper reports, without the accuracy question.

Run ``python -m benchmarks.run agentvocab`` (``--smoke`` for a tiny check); results as JSON.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch

from benchmarks.harness import Case

N_TRACES = 1000
N_CALLS = 20


@functools.lru_cache(maxsize=2)
def _setup(size: str) -> dict[str, Any]:
    from rankwise import zoo
    from rankwise.infer.agentvocab import MARKERS, AgentVocab, AgentVocabConfig, add_markers, continued_bpe
    from rankwise.zoo.agent_traces import agent_traces

    model, tok = zoo.tiny_lm(size)
    tok0, _ = add_markers(model, tok, MARKERS)
    n = N_TRACES if size != "smoke" else 60
    av = AgentVocab(tok0, AgentVocabConfig(structural_budget=96 if size != "smoke" else 8,
                                           content_budget=32 if size != "smoke" else 4,
                                           min_freq=10 if size != "smoke" else 5))
    rendered = av.render(agent_traces(n, 0))
    tokens = av.select_reachable(av.mine(rendered), rendered)
    expanded = copy.deepcopy(model)
    tok_av, _ = av.expand(expanded, tokens)
    tok_cb, cb_texts = continued_bpe(tok0, [r.text for r in rendered], len(tokens))
    cb_model = copy.deepcopy(model)
    from rankwise.infer.agentvocab import expand_model

    expand_model(cb_model, tok0, cb_texts)
    return {"rendered": rendered, "tokenizers": {"T0": tok0, "agentvocab": tok_av, "continued-bpe": tok_cb},
            "models": {"T0": model, "agentvocab": expanded, "continued-bpe": cb_model}, "n_new": len(tokens)}


def _encode(size: str, which: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        s = _setup(size)
        tok, texts = s["tokenizers"][which], [r.text for r in s["rendered"]]
        return lambda: tok(texts, add_special_tokens=False, verbose=False)

    return factory


@torch.no_grad()
def _forced(model: Any, prompt: list[int], call: list[int]) -> None:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    for t in call:
        out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past = out.past_key_values


def _decode(size: str, which: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.infer.agentvocab import call_text

        s = _setup(size)
        tok, model = s["tokenizers"][which], s["models"][which].eval()
        pairs = [(tok(r.prompt, add_special_tokens=False)["input_ids"],
                  tok(call_text(r.call), add_special_tokens=False)["input_ids"]) for r in s["rendered"][:N_CALLS]]

        def run() -> None:
            for p, c in pairs:
                _forced(model, p, c)

        return run

    return factory


def _cases(size: str, repeats: int) -> list[Case]:
    impls = ("T0", "agentvocab", "continued-bpe")
    return [
        Case(f"encode_corpus_{size}", {k: _encode(size, k) for k in impls}, anchor="T0",
             params={"lm": size, "traces": N_TRACES if size != "smoke" else 60}, repeats=repeats, warmup=1),
        Case(f"decode_call_{size}", {k: _decode(size, k) for k in impls}, anchor="T0",
             params={"lm": size, "calls": N_CALLS, "batch": 1, "kv_cache": True}, repeats=repeats, warmup=1),
    ]


CASES = _cases("small", 5)
SMOKE_CASES = _cases("smoke", 1)
