"""PAVE vs learnware's RKME: the cost of writing one specification, and of ranking a repository.

* ``pave_spec_vs_rkme``: one spec of 200 examples. Anchor: learnware's ``RKMETableSpecification`` (K = 100,
  3 rounds) on 200 L2-normalised 384-d embeddings (the embeddings themselves are not timed). PAVE: the
  reproduction's recipe on two seeded random MiniLM-shaped BERT layers (hidden 384, 12 heads, FFN 1536) run
  on cached lower-layer outputs of 32 tokens (rank 16 on query/key/value, batch 16, 30 steps). PAVE trains,
  RKME clusters: PAVE is expected to cost more; the case says by how much.
* ``identify_100``: rank 100 learnwares for one user. Anchor: RKME MMD^2 between 100-point reduced sets
  (ours, float64, equal to learnware's ``dist``); PAVE: cosine of specs of 37,634 numbers
  (:func:`rankwise.science.pave.identify`, comparability checks included). Goal: PAVE's ranking costs no
  more than RKME's.

``SMOKE_CASES``: 20 examples, 2 steps, 5 learnwares. Run ``python -m benchmarks.run pave``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch

from benchmarks.harness import Case, Goal

_HAS_LEARNWARE = all(importlib.util.find_spec(m) is not None for m in ("learnware", "fast_pytorch_kmeans"))


def _encoder() -> Any:
    from transformers import BertConfig, BertModel

    from rankwise.science.pave import TopEncoder

    torch.manual_seed(0)
    bert = BertModel(BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                                vocab_size=128))
    return TopEncoder(bert, (4, 5)).eval()


def _pave_spec(n: int, steps: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science import pave as pv

        enc = _encoder()
        g = torch.Generator().manual_seed(0)
        inputs = {"hidden": torch.randn(n, 32, 384, generator=g), "attention_mask": torch.ones(n, 32, dtype=torch.long)}
        y = torch.arange(n) % 2
        cfg = pv.PaveConfig(layers=(4, 5), steps=steps, max_length=32)
        return lambda: pv.spec_from_inputs(enc, inputs, y, cfg, fingerprint="sha256:bench")
    return factory


def _rkme_spec(n: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science import pave as pv

        x = torch.randn(n, 384, generator=torch.Generator().manual_seed(0))
        return lambda: pv.rkme_spec(x, k=100, seed=0)
    return factory


def _identify(kind: str, n_lw: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science import pave as pv

        g = torch.Generator().manual_seed(0)
        if kind == "PAVE cosine":
            cfg = pv.PaveConfig(layers=(4, 5)).to_dict()
            names = [f"encoder.layer.{i}.attention.self.{p}.lora_B" for i in (4, 5) for p in ("query", "key", "value")]

            def spec() -> Any:
                t = {n: torch.randn(384, 16, generator=g) for n in names}
                t.update({"head.weight": torch.randn(2, 384, generator=g), "head.bias": torch.randn(2, generator=g)})
                return pv.PaveSpec(t, cfg, "sha256:bench")
            user, lws = spec(), {str(i): spec() for i in range(n_lw)}
            return lambda: pv.identify(user, lws)
        def rk() -> Any:
            z = torch.nn.functional.normalize(torch.randn(100, 384, generator=g, dtype=torch.float64), dim=-1)
            beta = torch.full((100,), 0.01, dtype=torch.float64)
            return pv.RKMESpec(z, beta, 0.1, 200)
        user_r, lws_r = rk(), {str(i): rk() for i in range(n_lw)}
        return lambda: pv.rkme_identify(user_r, lws_r)
    return factory


def _cases(n: int, steps: int, n_lw: int, repeats: int) -> list[Case]:
    cases = [Case("identify_100" if n_lw == 100 else "identify", {k: _identify(k, n_lw) for k in ("RKME MMD", "PAVE cosine")},
                  anchor="RKME MMD", params={"learnwares": n_lw, "pave_numbers": 37634, "rkme_points": 100},
                  repeats=repeats, warmup=1,
                  goals=(Goal("PAVE ranking costs no more than RKME's", impl="PAVE cosine", max_ratio=1.0),))]
    if _HAS_LEARNWARE:
        cases.append(Case("pave_spec_vs_rkme", {"learnware RKME": _rkme_spec(n), "PAVE spec": _pave_spec(n, steps)},
                          anchor="learnware RKME", params={"examples": n, "pave_steps": steps, "tokens": 32},
                          repeats=repeats, warmup=1))
    return cases


CASES = _cases(200, 30, 100, 5)
SMOKE_CASES = _cases(20, 2, 5, 1)[:1]
