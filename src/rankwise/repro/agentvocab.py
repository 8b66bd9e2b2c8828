"""Reproduction of AgentVocab (ICML 2026): mined structural + content tokens cut the tokens and latency of
tool calls without hurting their accuracy.

Data (:mod:`rankwise.zoo.agent_traces`, seeded; the generator is documented there): 30 tools with JSON
schemas, single-call trajectories rendered by the hermes-like template (two tools listed in the system
prompt, the request, the call, the tool response, a short answer). Train: the first ``n_train``
trajectories of seed 0; test: ``n_test`` trajectories of generator seed 1.

* Stage 1 (cached, :mod:`rankwise.repro.kit.agentvocab_models`): ``zoo.tiny_lm("gqa")`` (Llama, 2 layers,
  hidden 256, 8 query / 2 KV heads, trained at context 1024, byte-level BPE of 2,048) with the template markers
  as single tokens, fully fine-tuned 300 steps of 8 trajectories on 5,000 train trajectories with its own
  tokenizer.
* Stage 2, the same budget per arm (``steps`` batches of ``batch_size``, same seed and data order), also
  cached per seed (``agentvocab_models.trained_arms``; ``rankwise zoo build`` builds the quick and full
  recipes, so a warm run only evaluates): **vanilla** continues with T0; **AgentVocab** mines the train
  trajectories (structural n-grams; TL-BPE content candidates ranked by the stage-1 model's embedding
  gradients on ``grad_samples`` sequences), keeps the reachable top ``structural_budget`` +
  ``content_budget``, adds them with mean-initialised rows and continues with the expanded tokenizer.
* Tokenizer-only contrasts (no training): **structural-only** (``structural_only_budget`` structural
  tokens) and **continued BPE** (the same number of merges appended to T0's), measured on the gold calls.
* Evaluation on the test requests: greedy decoding with the KV cache until ``</tool_call>`` (batched for
  accuracy; batch 1 for latency, median of ``latency_repeats`` runs per call on the first ``n_latency``
  requests), exact match of the parsed call (name + arguments, JSON types included), prompt tokens and
  generated tokens per call.

Checks (thresholds are the spec's, fixed before any run):

(1) output tokens per call: mean per-call reduction AgentVocab vs vanilla >= 30 % (paired per request);
(2) median latency per call: reduction >= 15 % (a claim in full mode; reported in quick mode, as the spec
    says: on a shared CPU it holds only qualitatively);
(3) exact match: AgentVocab - vanilla >= -2 points (paired per request);
(4) structural-only achieves >= 70 % of the mixed vocabulary's reduction of gold-call tokens.
Wiring: decode(encode(s)) == s for every rendered trajectory under every tokenizer; new rows equal the
mean of their subtoken rows before training; every selected token is emitted on the train corpus; the
corpus never gets more tokens. Precondition: vanilla learned tool calling (exact match >= 0.2).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

from rankwise.infer.agentvocab import (
    AgentVocab,
    AgentVocabConfig,
    call_text,
    compression_report,
    continued_bpe,
    exact_match,
    generate_calls,
    parse_call,
    render_corpus,
    timed_call,
    token_counts,
)
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting

ID = "agentvocab"
CLAIM = ("AgentVocab (mined structural + content tokens, mean-initialised, fine-tuned) cuts output tokens per tool "
         "call by >= 30 % and median latency per call by >= 15 % versus the same model and budget without new "
         "tokens, with exact match within 2 points; structural tokens alone give >= 70 % of the token reduction.")

ARMS = ("vanilla", "agentvocab")
ROW = {"vanilla": "vanilla (T0, same budget)", "agentvocab": "AgentVocab (mixed)",
       "structural": "structural-only (tokenizer)", "cbpe": "continued BPE (tokenizer)"}
MIN_OUT_REDUCTION = 0.30   # claim 1
MIN_LAT_REDUCTION = 0.15   # claim 2
EM_TOLERANCE = -0.02       # claim 3
MIN_STRUCT_SHARE = 0.70    # claim 4
MIN_VANILLA_EM = 0.20      # precondition


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentVocabSettings(Settings):
    """What the AgentVocab reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    stage1: str = setting("small", "stage-1 checkpoint (repro.kit.agentvocab_models recipe)", choices=("small", "smoke"))
    n_train: int = setting(5000, "train trajectories (mining and stage 2)", lo=10)
    n_test: int = setting(1000, "test requests", lo=1)
    steps: int = setting(600, "stage-2 steps per arm (the same budget for both)", lo=1)
    batch_size: int = setting(8, "trajectories per step", lo=1)
    lr: float = setting(1e-3, "stage-2 AdamW learning rate (both arms)", lo=0.0)
    max_length: int = setting(1024, "tokens per training sequence", lo=16)
    structural_budget: int = setting(96, "structural tokens of the mixed vocabulary", lo=0)
    content_budget: int = setting(32, "content tokens of the mixed vocabulary", lo=0)
    structural_only_budget: int = setting(128, "tokens of the structural-only contrast", lo=0)
    min_freq: int = setting(10, "minimum candidate frequency", lo=1)
    grad_samples: int = setting(200, "sequences whose embedding gradients rank content candidates", lo=0)
    max_new_tokens: int = setting(96, "greedy decoding budget per call", lo=1)
    n_latency: int = setting(50, "test requests timed at batch 1", lo=1)
    latency_repeats: int = setting(3, "timed runs per request (median)", lo=1)
    latency_claim: bool = setting(True, "check claim 2 (else latency is reported only)")


SETTINGS: dict[str, AgentVocabSettings] = {
    "smoke": AgentVocabSettings(stage1="smoke", n_train=60, n_test=6, steps=2, batch_size=2, max_length=512,
                                structural_budget=12, content_budget=4, structural_only_budget=16, min_freq=5,
                                grad_samples=4, max_new_tokens=8, n_latency=2, latency_repeats=1,
                                latency_claim=False, seeds=(0,)),
    # quick: the spec's quick mode (1000 trajectories, 300 steps, K = 64, seed 0; latency reported) scored on 150
    # test requests instead of 200: with the arms cached, evaluation is the whole cost (69.5 CPU s at 200)
    "quick": AgentVocabSettings(n_train=1000, n_test=150, steps=300, batch_size=4, structural_budget=48, content_budget=16,
                                structural_only_budget=64, grad_samples=64, n_latency=10, latency_claim=False,
                                seeds=(0,)),
    # full: the spec's sizes and three seeds, scored on 600 test requests per seed instead of 1000 (an estimated
    # 13 CPU minutes warm at 1000; evaluation dominates)
    "full": AgentVocabSettings(n_test=600, seeds=(0, 1, 2)),
}


def _roundtrip_failures(tok: Any, texts: list[str]) -> int:
    enc = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return sum(tok.decode(ids, clean_up_tokenization_spaces=False) != t for ids, t in zip(enc, texts))


class AgentVocabReproduction(Reproduction[AgentVocabSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1

    @staticmethod
    def _recipe(s: AgentVocabSettings) -> Any:
        from rankwise.repro.kit.agentvocab_models import ArmsRecipe

        return ArmsRecipe(stage1=s.stage1, n_train=s.n_train, steps=s.steps, batch_size=s.batch_size, lr=s.lr,
                          max_length=s.max_length, structural_budget=s.structural_budget,
                          content_budget=s.content_budget, structural_only_budget=s.structural_only_budget,
                          min_freq=s.min_freq, grad_samples=s.grad_samples)

    def _vocab(self, s: AgentVocabSettings, arms: dict[str, Any]) -> dict[str, Any]:
        """Seed-independent: data, the tokenizers and their wiring checks (once per run). The mined tokens come
        from the cached arms (mining is seed-independent; the arms were trained on them)."""
        if getattr(self, "_v", None) is not None:
            return self._v
        from rankwise.zoo.agent_traces import agent_traces

        info = arms["info"]
        tok0, tok_av = arms["vanilla"][1], arms["agentvocab"][1]
        train, _ = render_corpus(agent_traces(s.n_train, 0))
        test, _ = render_corpus(agent_traces(s.n_test, 1))
        av = AgentVocab(tok0, AgentVocabConfig(min_freq=s.min_freq))
        mixed = [c["text"] for c in info["mixed"]]
        tok_st, _ = av.expand(None, [c["text"] for c in info["structural_only"]])
        texts = [r.text for r in train]
        tok_cb, cb_tokens = continued_bpe(tok0, texts, len(mixed))
        # wiring: every selected token is emitted on the train corpus; the corpus never grows
        emitted = set(i for ids in tok_av(texts, add_special_tokens=False, verbose=False)["input_ids"] for i in ids)
        unreached = sum(i not in emitted for i in range(len(tok0), len(tok_av)))
        growth = max(0, sum(token_counts(tok_av, texts)) - sum(token_counts(tok0, texts)))
        all_texts = texts + [r.text for r in test]
        rt = sum(_roundtrip_failures(t, all_texts) for t in (tok0, tok_av, tok_st))
        self._v = {
            "test": test, "stage1": info["stage1"],
            "reports": {k: compression_report(test, tok0, t).as_dict()
                        for k, t in (("agentvocab", tok_av), ("structural", tok_st), ("cbpe", tok_cb))},
            "n_structural": sum(c["stream"] == "structural" for c in info["mixed"]),
            "n_content": sum(c["stream"] == "content" for c in info["mixed"]),
            "n_candidates": info["n_candidates"], "n_cbpe": len(cb_tokens),
            "unreached": unreached, "growth": growth, "roundtrip_failures": rt, "examples": mixed[:12],
        }
        return self._v

    def _evaluate(self, model: Any, tok: Any, s: AgentVocabSettings, test: list[Any]) -> dict[str, Any]:
        stop = tok.convert_tokens_to_ids("</tool_call>")
        prompts = [r.prompt for r in test]
        c0 = time.process_time()
        dec = generate_calls(model, tok, prompts, stop_id=stop, max_new_tokens=s.max_new_tokens)
        c1 = time.process_time()
        correct = [float(exact_match(parse_call(d.text), r.call)) for d, r in zip(dec, test)]
        lat = []
        timed_call(model, tok, prompts[0], stop_id=stop, max_new_tokens=s.max_new_tokens)  # warm-up
        for p in prompts[:s.n_latency]:
            lat.append(statistics.median(timed_call(model, tok, p, stop_id=stop, max_new_tokens=s.max_new_tokens)[1]
                                         for _ in range(s.latency_repeats)))
        return {"correct": correct, "out": [len(d.ids) for d in dec], "prompt": token_counts(tok, prompts),
                "gold": token_counts(tok, [call_text(r.call) for r in test]), "latency": lat,
                "cpu_s": {"generate": c1 - c0, "latency": time.process_time() - c1}}

    def measure(self, s: AgentVocabSettings, seed: int) -> dict[str, Any]:
        from rankwise.repro.kit.agentvocab_models import trained_arms

        c0 = time.process_time()
        arms = trained_arms(self._recipe(s), seed)  # cached by ``rankwise zoo build``: no training here when warm
        cpu = {"load": time.process_time() - c0}
        c0 = time.process_time()
        v = self._vocab(s, arms)
        cpu["tokenizers"] = time.process_time() - c0
        rec: dict[str, Any] = {"arms": {}, "cpu_s": cpu}
        for arm in ARMS:
            model, tok = arms[arm]
            c0 = time.process_time()
            ev = self._evaluate(model, tok, s, v["test"])
            cpu[arm] = time.process_time() - c0
            ev["final_loss"] = arms["info"]["arms"][arm]["final_loss"]
            rec["arms"][arm] = ev
        for k in ("reports", "n_structural", "n_content", "n_candidates", "n_cbpe", "unreached", "growth",
                  "roundtrip_failures", "examples"):
            rec[k] = v[k]
        rec["mean_init_error"] = arms["info"]["mean_init_error"]
        rec["stage1"] = v["stage1"]
        return rec

    def table(self, s: AgentVocabSettings, records: Records[dict]) -> Table:
        t = Table(columns=["exact match", "output tokens/call", "prompt tokens", "gold call tokens",
                           "median latency (ms)", "final loss"],
                  notes={"output tokens/call": "generated tokens up to and including </tool_call>",
                         "gold call tokens": "tokens of the reference call block under the arm's tokenizer"})
        for r in records:
            for arm in ARMS:
                a = r["arms"][arm]
                t.add(ROW[arm], "exact match", statistics.fmean(a["correct"]))
                t.add(ROW[arm], "output tokens/call", statistics.fmean(a["out"]))
                t.add(ROW[arm], "prompt tokens", statistics.fmean(a["prompt"]))
                t.add(ROW[arm], "gold call tokens", statistics.fmean(a["gold"]))
                t.add(ROW[arm], "median latency (ms)", 1e3 * statistics.median(a["latency"]))
                t.add(ROW[arm], "final loss", a["final_loss"])
            for k in ("structural", "cbpe"):
                rep = r["reports"][k]
                t.add(ROW[k], "prompt tokens", rep["prompt_after"])
                t.add(ROW[k], "gold call tokens", rep["call_after"])
        self._t = t
        return t

    @staticmethod
    def _per_call(records: Records[dict], key: str) -> list[list[float]]:
        return [[1.0 - b / a for a, b in zip(r["arms"]["vanilla"][key], r["arms"]["agentvocab"][key])] for r in records]

    def preconditions(self, s: AgentVocabSettings, records: Records[dict]) -> list[Precondition]:
        return [Precondition("vanilla learned tool calling: exact match", self._t.mean(ROW["vanilla"], "exact match"),
                             ">=", MIN_VANILLA_EM)]

    def checks(self, s: AgentVocabSettings, records: Records[dict]) -> list[ClaimCheck]:
        out = self._per_call(records, "out")
        em = [[b - a for a, b in zip(r["arms"]["vanilla"]["correct"], r["arms"]["agentvocab"]["correct"])]
              for r in records]
        lat = statistics.fmean(1.0 - statistics.median(r["arms"]["agentvocab"]["latency"])
                               / statistics.median(r["arms"]["vanilla"]["latency"]) for r in records)
        mixed = statistics.fmean(r["reports"]["agentvocab"]["call_reduction"] for r in records)
        struct = statistics.fmean(r["reports"]["structural"]["call_reduction"] for r in records)
        mean = lambda xs: statistics.fmean(statistics.fmean(x) for x in xs)  # noqa: E731
        checks = [
            ClaimCheck("(1) output tokens per call: mean reduction AgentVocab vs vanilla", mean(out), ">=",
                       MIN_OUT_REDUCTION, samples=out),
            ClaimCheck("(2) median latency per call: reduction AgentVocab vs vanilla (batch 1, KV cache)", lat, ">=",
                       MIN_LAT_REDUCTION),
            ClaimCheck("(3) exact match AgentVocab - vanilla", mean(em), ">=", EM_TOLERANCE, samples=em),
            ClaimCheck("(4) structural-only / mixed reduction of gold-call tokens", struct / mixed if mixed > 0 else 0.0,
                       ">=", MIN_STRUCT_SHARE),
            ClaimCheck("decode(encode(s)) != s over every rendered trajectory and tokenizer: count",
                       float(records.first["roundtrip_failures"]), "<=", 0.0, kind="wiring"),
            ClaimCheck("new rows - mean of their subtoken rows before training: max |difference|",
                       float(records.first["mean_init_error"]), "<=", 0.0, kind="wiring"),
            ClaimCheck("selected tokens never emitted on the train corpus: count", float(records.first["unreached"]),
                       "<=", 0.0, kind="wiring"),
            ClaimCheck("train-corpus tokens added by the expansion", float(records.first["growth"]), "<=", 0.0,
                       kind="wiring"),
        ]
        if not s.latency_claim:
            checks.pop(1)
        return checks

    def extra(self, s: AgentVocabSettings, records: Records[dict]) -> dict[str, Any]:
        r = records.first
        lat = {arm: [1e3 * statistics.median(x["arms"][arm]["latency"]) for x in records] for arm in ARMS}
        return {"compression_reports": r["reports"], "candidates": r["n_candidates"], "selected_examples": r["examples"],
                "median_latency_ms": lat, "stage1": r["stage1"],
                "cpu_s_per_seed": [dict(x["cpu_s"], **{f"{a}_parts": x["arms"][a]["cpu_s"] for a in ARMS})
                                   for x in records]}

    def figures(self, s: AgentVocabSettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        rows = [ROW[a] for a in ARMS]
        for ax, col in zip(axes, ("output tokens/call", "exact match")):
            ax.bar(range(len(rows)), [self._t.mean(r, col) for r in rows], color=["#999", "#2a7"])
            ax.set_xticks(range(len(rows)), ["vanilla", "AgentVocab"])
            ax.set_title(col, fontsize=10)
        fig.tight_layout()
        return [save_figure(fig, out_dir / "agentvocab.png")]

    def notes(self, s: AgentVocabSettings, records: Records[dict]) -> str:
        r = records.first
        rep = r["reports"]
        lat = {k: ", ".join(f"{x:.0f}" for x in v) for k, v in self.extra(s, records)["median_latency_ms"].items()}
        return (f"Vocabulary: {r['n_structural']} structural + {r['n_content']} content tokens from "
                f"{r['n_candidates']['structural']} structural / {r['n_candidates']['content']} content candidates "
                f"(stage-1 model: final loss {r['stage1']['final_loss']:.3f}). On the test trajectories the mixed "
                f"vocabulary removes {100 * rep['agentvocab']['prompt_reduction']:.1f} % of prompt tokens and "
                f"{100 * rep['agentvocab']['call_reduction']:.1f} % of gold-call tokens; structural-only "
                f"({s.structural_only_budget} tokens) {100 * rep['structural']['call_reduction']:.1f} %; continued BPE "
                f"with the same budget {100 * rep['cbpe']['call_reduction']:.1f} % of call tokens and "
                f"{100 * rep['cbpe']['prompt_reduction']:.1f} % of prompt tokens. Median batch-1 latency (ms) vanilla "
                f"{lat['vanilla']} vs AgentVocab {lat['agentvocab']} ({_load_note()}). The structural-only and "
                "continued-BPE rows are tokenizer-only (not trained).")


def _load_note() -> str:
    """The machine state the wall-clock latencies were timed in: a CPU with more runnable jobs than cores
    stretches both arms' times unevenly, so the latency comparison is then only qualitative."""
    cpus = os.cpu_count() or 1
    if not hasattr(os, "getloadavg"):
        return f"{cpus} CPUs, load unknown"
    load = os.getloadavg()[0]
    busy = load > cpus
    return (f"load average {load:.1f} on {cpus} CPUs"
            + (": more runnable jobs than cores, so latency holds only qualitatively" if busy else ""))


REPRODUCTION = AgentVocabReproduction
run = AgentVocabReproduction.run
