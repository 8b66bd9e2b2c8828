"""Reproduction of Compress-then-Merge (CtM) on the embedded MiniLM: T task LoRAs -> one rank-8 LoRA.

Setting (spec "Reproduction at small scale", adapted to the zoo): the pretrained all-MiniLM-L6-v2,
frozen; one LoRA (rank 8, alpha 8) per zoo text task on ``query``/``key``/``value``/
``attention.output.dense`` of the top encoder layer, each trained with its own linear head on
mean-pooled tokens (:mod:`rankwise.repro.kit.task_loras`, trained once per (task, seed) and cached). The
T LoRAs are merged into ONE rank-8 LoRA by each method; every task is then evaluated with the
merged LoRA and its own head. Metric: normalized accuracy = merged accuracy / the task's individual
LoRA accuracy, averaged over tasks (the paper's metric).

Rows (all single-LoRA-output methods give a rank-8 LoRA):

* **CtM-TIES**, **CtM-TA** — :func:`rankwise.merge.ctm.merge`;
* **MtC-TA (PEFT svd)**, **MtC-TIES (PEFT ties_svd)** — PEFT's own ``add_weighted_adapter`` with
  ``svd_rank=8`` on the same LoRAs (the full-space merge-then-compress baselines, run by the library
  users already have); full mode adds **MtC-DARE-TIES (PEFT dare_ties_svd)**;
* **Core-TIES (truncated)**, **Iso-C (full, truncated)** — :mod:`rankwise.merge.baselines`;
* references (not rank 8): **TIES (full rank)** and **TA (full rank)**, the untruncated merges, and
  **no adapter** (the base encoder with each task's head).

Quick mode (one-thread CPU time measured on an empty cache, i.e. including the training of its six
LoRAs: see docs/methods/ctm.md) runs the four rows the claim compares (CtM-TIES, CtM-TA, MtC-TIES, MtC-TA) on
:data:`QUICK_TASKS` (the tasks whose LoRA clearly beats no adapter on validation) with λ in {0.5, 1, 1.5};
full mode runs every row on the six tasks of
:data:`rankwise.repro.kit.task_loras.TASKS` with the whole grid (its LoRAs for the quick tasks and seeds 0, 1
are the quick mode's, from the same cache). (KnOTS-space merging is in the library and the CLI but not in
the reproduction, for time.) What runs is :class:`CtmSettings` (``SETTINGS[mode]``; ``rankwise reproduce
ctm --set lambdas=0.5,1``): the tasks, the LoRA recipe (the cached one, or smoke's tiny in-memory one), the
tuning grids and their starting point, the rows, the merged rank, DARE's drop rate, which form of claim (1)
is checked, and the quick-mode task precondition.

Tuning on the validation split (held out from each task's training data), the same sequential
budget for every method as in the paper: λ over the grid with topK = 30 % and β = 0.25; then topK
(TIES/DARE rules only); then β (CtM only). The chosen setting is evaluated once on the test split.

Checks (spec "THE CLAIM"): (1) CtM-TIES beats MtC-TIES (full space) by >= 1.0 normalized-accuracy
point over seeds (quick and smoke mode: the reduced >= -0.5 point; a ``claim`` check whose paired samples
are per-example differences of correctness weighted so that their mean is the normalized-accuracy gap,
so it carries a bootstrap interval); (2) the best CtM variant >= the best truncated baseline (full mode;
``claim``); (3) every CtM output has numerical rank <= 8 per layer (by construction; ``wiring``).

Preconditions (with the conversion to the skeleton; they can only move the verdict to ``inconclusive``):
the upper-bound row beats the lower-bound row (the individual LoRAs' mean test accuracy exceeds the no-adapter
row's: a merge comparison needs LoRAs that learned something beyond their heads); in quick mode also the
task rule that chose :data:`QUICK_TASKS`, on this run's seeds (every task's LoRA beats no adapter by >= 2
points of validation accuracy, mean over seeds; the rule's threshold :data:`QUICK_MIN_VAL_GAIN`).

The quick task rule is frozen (see :data:`QUICK_TASKS`): it was written after a failing result, so quick mode
also runs it, unchanged, on an independent draw (``confirm_seed`` = 2: that seed's LoRAs of all six tasks,
their validation gains, the rule, then claim (1) on the picked tasks with that seed), reported as its own
table rows and claim check; a precondition asks that the draw leaves at least two tasks to merge.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.core.lora import AdapterState
from rankwise.merge import baselines
from rankwise.merge.ctm import CtMConfig
from rankwise.merge.ctm import merge as ctm_merge
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.kit.minilm import MiniLMReproduction
from rankwise.repro.skeleton import Records, Settings, pyplot, save_figure, setting

ID = "ctm"
CLAIM = ("Compressing T task LoRAs into shared rank-r subspaces before merging (CtM) gives one rank-r LoRA with "
         "higher mean normalized accuracy than merging in full space and truncating (merge-then-compress).")
RANK = 8
LAMBDAS_FULL = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)
SMOKE_RECIPE = {"version": 1, "model": "all-MiniLM-L6-v2", "top_layers": 1,
                "targets": ["query", "key", "value", "attention.output.dense"], "rank": 8, "alpha": 8.0,
                "lr": 1e-3, "head_lr": 1e-2, "epochs": 1, "batch_size": 16, "max_length": 16, "max_train": 80,
                "n_val": 16, "max_test": 32, "head_std": 0.02}
#: quick mode's three tasks, chosen by a precondition of the experiment, never by the merge rows: a merge
#: comparison needs task LoRAs that learn something beyond their heads. Rule: the LoRA's VALIDATION accuracy
#: minus the no-adapter validation accuracy (base encoder + the same trained task head), mean over seeds 0
#: and 1, must be >= 2 points (2 of the 96 validation examples); if more than three pass, the cheapest to
#: train (fewest training examples) first (:func:`quick_task_rule`). Measured with recipe v4 (points;
#: one-thread CPU s to train the LoRA, seeds 0 / 1; 2026-11-30):
#:
#:   task              n_train  gain s0  gain s1  mean   train CPU s
#:   topic             504      +2.1     +7.3     +4.7   8.7 / 7.5    passes
#:   c_signature       168      +5.2     +4.2     +4.7   3.9 / 3.4    passes
#:   files_vs_formats  230      +2.1     +5.2     +3.6   4.8 / 4.1    passes
#:   kind              504      -2.1      0.0     -1.0   8.6 / 7.6
#:   private           504      -1.0     -2.1     -1.6   8.4 / 7.6
#:   dunder            208      -1.0     -5.2     -3.1   4.1 / 3.6
#:
#: Exactly three pass. (Until 2026-11-30 quick mode used the three cheapest tasks, c_signature, dunder and
#: files_vs_formats; dunder's LoRA is below no adapter on validation, which made that comparison uninformative.)
#:
#: FROZEN (2026-12-01, after review): the rule above was written after a failing quick result on the earlier
#: tasks, so it may fit seeds 0 and 1. It is not changed again; instead every quick run applies the same rule,
#: unchanged, to an independent draw (``CtmSettings.confirm_seed``, seed 2: its own LoRAs, its own validation
#: gains, one seed) and checks the claim on the tasks that draw picks, as a separate claim check and table rows
#: (``_independent_draw``).
QUICK_TASKS = ("topic", "c_signature", "files_vs_formats")
#: the precondition above, in points of validation accuracy (recorded per run in ``extra``, not a claim)
QUICK_MIN_VAL_GAIN = 2.0
QUICK_ROWS = ("CtM-TIES", "CtM-TA", "MtC-TIES (PEFT ties_svd)", "MtC-TA (PEFT svd)")
DENSITY0, BETA0, DROP = 0.3, 0.25, 0.1
MARGIN_FULL = 1.0      # claim (1), points of normalized accuracy, CtM-TIES - MtC-TIES
MARGIN_REDUCED = -0.5  # the spec's reduced claim (1) of quick (and smoke) mode
ALL_ROWS = ("CtM-TIES", "CtM-TA", "MtC-TIES (PEFT ties_svd)", "MtC-TA (PEFT svd)", "Core-TIES (truncated)",
            "Iso-C (full, truncated)", "MtC-DARE-TIES (PEFT dare_ties_svd)", "TIES (full rank, reference)",
            "TA (full rank, reference)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CtmSettings(Settings):
    """What the CtM reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    tasks: tuple[str, ...] | None = setting(QUICK_TASKS, "zoo text tasks, one LoRA each (None: task_loras.TASKS)")
    recipe: str = setting("cached", "task-LoRA recipe: 'cached' (task_loras.RECIPE, trained once and cached) or "
                                    "'smoke' (SMOKE_RECIPE, tiny, trained in memory)", choices=("cached", "smoke"))
    lambdas: tuple[float, ...] = setting((0.5, 1.0, 1.5), "λ grid (tuned first, on validation)", lo=0.0)
    topks: tuple[float, ...] = setting((), "topK grid of the TIES/DARE rows (tuned second; empty: fixed)", lo=0.0,
                                       hi=1.0)
    betas: tuple[float, ...] = setting((), "β grid of the CtM rows (tuned last; empty: fixed)", lo=0.0, hi=1.0)
    density0: float = setting(DENSITY0, "topK while λ is tuned (and when not tuned)", lo=0.0, hi=1.0)
    beta0: float = setting(BETA0, "β while λ and topK are tuned (and when not tuned)", lo=0.0, hi=1.0)
    drop_rate: float = setting(DROP, "DARE's drop rate", lo=0.0, hi=1.0)
    rank: int = setting(RANK, "rank of the merged LoRA (CtM and the truncated baselines)", lo=1)
    full_rows: bool = setting(False, "also build MtC-DARE-TIES (PEFT dare_ties_svd)")
    rows: tuple[str, ...] | None = setting(QUICK_ROWS, "merge rows run (None: every row built)")
    reduced_claim: bool = setting(True, "check the spec's reduced claim (1), CtM-TIES >= MtC-TIES - 0.5 point, "
                                        "instead of >= + 1.0 point and claim (2)")
    min_val_gain: float | None = setting(QUICK_MIN_VAL_GAIN, "precondition: every task's LoRA beats no adapter by "
                                                             "this many points of validation accuracy, mean over "
                                                             "seeds (None: not checked)")
    confirm_seed: int | None = setting(2, "an independent task draw: quick_task_rule applied, unchanged, to this "
                                          "seed's LoRAs of every task (its validation gains only), then claim (1) "
                                          "checked on the tasks it picks with this seed (None: not run)", lo=0)

    def validate(self) -> None:
        if not self.lambdas:
            raise ValueError("CtmSettings.lambdas must not be empty")
        unknown = [r for r in (self.rows or ()) if r not in ALL_ROWS]
        if unknown:
            raise ValueError(f"CtmSettings.rows must be among {ALL_ROWS}, got {unknown}")
        need = {"CtM-TIES", "MtC-TIES (PEFT ties_svd)"}
        if self.rows is not None and not need <= set(self.rows):
            raise ValueError(f"CtmSettings.rows must include CtM-TIES and MtC-TIES (PEFT ties_svd), got {self.rows}")
        if not self.reduced_claim and self.rows is not None:
            raise ValueError("CtmSettings.rows must be None (every row) when reduced_claim is false: claim (2) "
                             "compares the best CtM row with every truncated baseline")


SETTINGS: dict[str, CtmSettings] = {
    # smoke trains its tiny LoRAs in memory (no cache writes) and runs every row once;
    # quick/full use the cached RECIPE LoRAs of rankwise.repro.kit.task_loras
    "smoke": CtmSettings(tasks=("topic", "kind"), recipe="smoke", lambdas=(1.0,), full_rows=True, rows=None,
                         min_val_gain=None, confirm_seed=None),
    "quick": CtmSettings(),
    "full": CtmSettings(tasks=None, lambdas=LAMBDAS_FULL, topks=(0.1, 0.25, 0.5, 1.0), betas=(0.0, 0.25, 0.5, 0.75),
                        full_rows=True, rows=None, reduced_claim=False, min_val_gain=None, confirm_seed=None),
}




# ------------------------------------------------------------------------------------------------
# evaluation of one adapter on every task
# ------------------------------------------------------------------------------------------------

class Evaluator:
    """Scores one adapter on every task: the adapted top layers run on all tasks' cached inputs, each task's head.

    The frozen-prefix outputs of the validation and test texts come from
    :func:`rankwise.repro.kit.task_loras.encode_task` (shared with the LoRA training inside
    :func:`~rankwise.repro.kit.task_loras.shared_encodings`). An adapter is applied by setting each adapted
    Linear's weight to ``W_0 + s B A`` (computed in float64), which is the same function as running
    the LoRA branch beside ``W_0`` but costs no extra matmuls (the untruncated references are rank-384
    "LoRAs"). Rows are evaluated in chunks of similar token length (little padding); the order does
    not change any accuracy. ``base_memo`` (optional, shared across seeds) keeps the base encoder's
    pooled embeddings of a split, which do not depend on the seed when the split's texts do not.
    """

    CHUNK = 64

    def __init__(self, bert: nn.Module, tok: Any, loras: list[Any], datas: list[Any], recipe: dict[str, Any],
                 base_memo: dict[Any, torch.Tensor] | None = None) -> None:
        from rankwise.repro.kit.cached_encoder import FrozenPrefix
        from rankwise.repro.kit.task_loras import encode_task, top_model

        prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - recipe["top_layers"], recipe["max_length"])
        self.splits: dict[str, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = {}
        self.keys: dict[str, tuple[Any, ...]] = {}
        for split in ("val", "test"):
            hs, ms, ys = [], [], []
            for d in datas:
                h, m, y = encode_task(prefix, getattr(d, split))
                hs.append(h)
                ms.append(m)
                ys.append(y)
            h, m = torch.cat(hs), torch.cat(ms)
            order = torch.sort(m.sum(1), stable=True).indices  # rows by token length
            position = torch.empty_like(order)
            position[order] = torch.arange(len(order))
            rows, start = [], 0
            for y in ys:  # where each task's examples sit in the length-sorted order
                rows.append(position[start:start + len(y)])
                start += len(y)
            self.splits[split] = (h[order].contiguous(), m[order].contiguous(), ys, rows)
            self.keys[split] = (id(bert), recipe["top_layers"], recipe["max_length"],
                                tuple(tuple(t for t, _ in getattr(d, split)) for d in datas))
        self.heads = [(tl.head["weight"].float(), tl.head["bias"].float()) for tl in loras]
        self.model = top_model(bert, 2, 0, recipe)
        self.model.eval()
        self.w0 = {n: mod.weight.detach().clone() for n, mod in self.model.named_modules()
                   if isinstance(mod, nn.Linear) and n.endswith(tuple(recipe["targets"])) and n.startswith("layers.")}
        self.base_memo = base_memo if base_memo is not None else {}
        self.evals = 0

    @torch.no_grad()
    def _set(self, state: AdapterState | None) -> None:
        if state is not None:
            unknown = [m for m in state.modules() if m not in self.w0]
            if unknown:
                raise ValueError(f"adapter modules {unknown[:3]} are not adapted layers of the evaluator "
                                 f"(known: {sorted(self.w0)[:4]} ...)")
        mods = set(state.modules()) if state is not None else set()
        for name, w0 in self.w0.items():
            w = w0 if name not in mods else (w0.double() + state.delta_weight(name, torch.float64)).to(w0.dtype)
            self.model.get_submodule(name).weight.copy_(w)

    @torch.no_grad()
    def embeddings(self, state: AdapterState | None, split: str) -> list[torch.Tensor]:
        """Per task, the pooled sentence embeddings ``(N_t, H)`` of ``split`` (in the task's example order)."""
        from rankwise.repro.kit.cached_encoder import trim_padding

        h, m, ys, rows = self.splits[split]
        emb = self.base_memo.get(self.keys[split]) if state is None else None
        if emb is None:
            self._set(state)
            emb = torch.cat([self.model.pooled(*trim_padding(h[i:i + self.CHUNK], m[i:i + self.CHUNK]))
                             for i in range(0, h.shape[0], self.CHUNK)])
            self.evals += 1
            if state is None:
                self.base_memo[self.keys[split]] = emb
        return [emb[r] for r in rows]

    def hits(self, state: AdapterState | None, split: str) -> list[torch.Tensor]:
        """Per task, whether each example of ``split`` is classified right (bool, in the task's example order)."""
        ys = self.splits[split][2]
        return [(e @ W.T + b).argmax(-1) == y for e, (W, b), y in zip(self.embeddings(state, split), self.heads, ys)]

    def accuracies(self, state: AdapterState | None, split: str) -> list[float]:
        """Per-task accuracy on ``split`` with ``state`` as the (only) adapter; ``None``: the base encoder."""
        return [float(h.double().mean()) for h in self.hits(state, split)]


def quick_task_rule(gains: dict[str, Sequence[float]], n_train: dict[str, int], k: int = 3,
                    min_gain: float = QUICK_MIN_VAL_GAIN) -> tuple[str, ...]:
    """Quick mode's task choice: tasks whose mean validation gain (points, LoRA - no adapter) is >= ``min_gain``,
    the ``k`` with the fewest training examples among them (ties by name). Raises if fewer than ``k`` pass."""
    passing = [t for t, g in gains.items() if len(g) and statistics.fmean(g) >= min_gain]
    if len(passing) < k:
        raise ValueError(f"only {len(passing)} tasks ({passing}) have a mean validation gain >= {min_gain} points; "
                         f"quick mode needs {k}")
    return tuple(sorted(passing, key=lambda t: (n_train[t], t))[:k])


def _norm_acc(accs: Sequence[float], ref: Sequence[float]) -> float:
    return statistics.fmean(a / max(r, 1e-9) for a, r in zip(accs, ref))


# ------------------------------------------------------------------------------------------------
# methods
# ------------------------------------------------------------------------------------------------

def _peft_merge(states: list[AdapterState], ctype: str, lam: float, density: float, seed: int, rank: int = RANK
                ) -> AdapterState:
    """PEFT's ``LoraModel.add_weighted_adapter`` on the task LoRAs (weights λ each, ``svd_rank`` = ``rank``)."""
    import peft

    mods = states[0].modules()
    holder = nn.Module()
    for m in mods:  # a shell with one Linear per adapted module, at the same dotted path
        out_f, in_f = states[0].shape(m)
        parent = holder
        parts = m.split(".")
        for p in parts[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, nn.Module())
            parent = getattr(parent, p)
        parent.add_module(parts[-1], nn.Linear(in_f, out_f, bias=False))
    r0 = states[0].rank(mods[0])
    cfg = peft.LoraConfig(r=r0, lora_alpha=r0, target_modules=mods, lora_dropout=0.0)
    lm = peft.LoraModel(holder, {"t0": cfg}, "t0")
    names = [f"t{i}" for i in range(len(states))]
    for name in names[1:]:
        lm.peft_config[name] = copy.deepcopy(cfg)
        lm.inject_adapter(holder, name)
    with torch.no_grad():
        for name, st in zip(names, states):
            for m in mods:
                layer = holder.get_submodule(m)
                layer.lora_A[name].weight.copy_(st.factors[m]["lora_A"])
                layer.lora_B[name].weight.copy_(st.factors[m]["lora_B"])
                layer.scaling[name] = st.scaling[m]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # PEFT's DARE draws from the global RNG
        lm.add_weighted_adapter(names, [lam] * len(names), "merged", combination_type=ctype, svd_rank=rank,
                                density=density)
    factors, scaling = {}, {}
    for m in mods:
        layer = holder.get_submodule(m)
        factors[m] = {"lora_A": layer.lora_A["merged"].weight.detach().clone(),
                      "lora_B": layer.lora_B["merged"].weight.detach().clone()}
        scaling[m] = float(layer.scaling["merged"])
    return AdapterState({"method": f"peft-{ctype}", "rank": rank, "alpha": float(rank)}, factors, scaling)


def _full_rank_state(states: list[AdapterState], rule: str, lam: float, density: float) -> AdapterState:
    """The untruncated merge (reference), as an exact full-rank "LoRA": ``B = ΔW`` (m×n), ``A = I_n``."""
    deltas = baselines.merged_deltas(states, baselines.MergeConfig(rule=rule, scale=lam, density=density), rank=None)
    factors = {}
    for m, d in deltas.items():
        factors[m] = {"lora_A": torch.eye(d.shape[1], dtype=d.dtype), "lora_B": d.clone()}
    return AdapterState({"method": f"full-{rule}"}, factors, {m: 1.0 for m in deltas})


def _methods(full_rows: bool, seed: int, rank: int = RANK, drop: float = DROP
             ) -> dict[str, tuple[Callable[..., AdapterState], tuple[str, ...]]]:
    """name -> (build(states, lam, density, beta), tuned knobs beyond λ); the truncated rows give rank ``rank``."""
    def ctm(rule: str) -> Callable[..., AdapterState]:
        return lambda st, lam, dens, beta: ctm_merge(st, CtMConfig(rank=rank, rule=rule, scale=lam, density=dens,
                                                                   beta=beta, drop_rate=drop))

    def mtc(space: str, rule: str) -> Callable[..., AdapterState]:
        return lambda st, lam, dens, beta: baselines.merge(st, baselines.MergeConfig(
            rank=rank, rule=rule, space=space, scale=lam, density=dens, drop_rate=drop))

    def peft_(ctype: str) -> Callable[..., AdapterState]:
        return lambda st, lam, dens, beta: _peft_merge(st, ctype, lam, dens, seed, rank)

    out: dict[str, tuple[Callable[..., AdapterState], tuple[str, ...]]] = {
        "CtM-TIES": (ctm("ties"), ("topk", "beta")),
        "CtM-TA": (ctm("ta"), ("beta",)),
        "MtC-TIES (PEFT ties_svd)": (peft_("ties_svd"), ("topk",)),
        "MtC-TA (PEFT svd)": (peft_("svd"), ()),
        "Core-TIES (truncated)": (mtc("core", "ties"), ("topk",)),
        "Iso-C (full, truncated)": (mtc("full", "iso_c"), ()),
    }
    if full_rows:
        out["MtC-DARE-TIES (PEFT dare_ties_svd)"] = (peft_("dare_ties_svd"), ("topk",))
    out["TIES (full rank, reference)"] = (lambda st, lam, dens, beta: _full_rank_state(st, "ties", lam, dens), ("topk",))
    out["TA (full rank, reference)"] = (lambda st, lam, dens, beta: _full_rank_state(st, "ta", lam, dens), ())
    return out


TRUNCATED_BASELINES = ("MtC-TIES (PEFT ties_svd)", "MtC-TA (PEFT svd)", "Core-TIES (truncated)",
                       "Iso-C (full, truncated)", "MtC-DARE-TIES (PEFT dare_ties_svd)")
CTM_ROWS = ("CtM-TIES", "CtM-TA")


def _tune(build: Callable[..., AdapterState], knobs: tuple[str, ...], states: list[AdapterState], ev: Evaluator,
          ref_val: list[float], S: CtmSettings) -> tuple[dict[str, float], float]:
    """Sequential search on the validation split: λ, then topK, then β (each at the best so far)."""
    best = {"lam": S.lambdas[0], "density": S.density0, "beta": S.beta0}
    best_score = -1.0
    cache: dict[tuple[float, float, float], float] = {}

    def score(p: dict[str, float]) -> float:
        key = (p["lam"], p["density"], p["beta"])
        if key not in cache:
            cache[key] = _norm_acc(ev.accuracies(build(states, p["lam"], p["density"], p["beta"]), "val"), ref_val)
        return cache[key]

    for knob, grid in (("lam", S.lambdas), ("density", S.topks if "topk" in knobs else ()),
                       ("beta", S.betas if "beta" in knobs else ())):
        for v in grid:
            p = dict(best, **{knob: v})
            s = score(p)
            if s > best_score + 1e-12:
                best, best_score = p, s
    if best_score < 0:
        best_score = score(best)
    return best, best_score


def _numerical_rank(state: AdapterState) -> int:
    worst = 0
    for m in state.modules():
        s = torch.linalg.svdvals(state.delta_weight(m, torch.float64))
        worst = max(worst, int((s > 1e-6 * s[0]).sum()) if float(s[0]) > 0 else 0)
    return worst


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------

COLUMNS = ["normalized acc", "mean test acc", "val normalized acc", "max numerical rank"]
COLUMN_NOTES = {"normalized acc": "merged test accuracy / individual LoRA test accuracy, mean over tasks",
                "max numerical rank": "max over layers of #singular values > 1e-6 sigma_1 of the merged delta"}


def _recipe(S: CtmSettings) -> dict[str, Any]:
    from rankwise.repro.kit.task_loras import RECIPE

    return SMOKE_RECIPE if S.recipe == "smoke" else RECIPE


def _tasks(S: CtmSettings) -> tuple[str, ...]:
    from rankwise.repro.kit.task_loras import TASKS

    return tuple(S.tasks or TASKS)


def _weighted_hits(hits: list[torch.Tensor], ref: Sequence[float]) -> list[float]:
    """Per example, in points, ``100 c_i N / (T n_t r_t)``: their mean over the N examples of all T tasks is the
    normalized accuracy (mean over tasks of accuracy_t / r_t), so differences of two rows pair per example."""
    n, T = sum(len(h) for h in hits), len(hits)
    return [100.0 * float(c) * n / (T * len(h) * max(r, 1e-9)) for h, r in zip(hits, ref) for c in h.double()]


def _measure(seed: int, S: CtmSettings, bert: nn.Module, tok: Any, base_memo: dict[Any, torch.Tensor]
             ) -> dict[str, Any]:
    """One seed: load (or train) the task LoRAs, tune every row on validation, score on test."""
    from rankwise.repro.kit.task_loras import task_data, task_lora

    table = Table(columns=list(COLUMNS), notes=dict(COLUMN_NOTES))
    recipe, tasks = _recipe(S), _tasks(S)
    t0 = time.perf_counter()
    loras = [task_lora(t, seed, recipe=recipe, bert=bert, tokenizer=tok, cache=S.recipe == "cached") for t in tasks]
    t_train = time.perf_counter() - t0
    datas = [task_data(t, seed, recipe) for t in tasks]
    ev = Evaluator(bert, tok, loras, datas, recipe, base_memo)
    states = [tl.state for tl in loras]
    indiv_val = [tl.metrics["val_acc"] for tl in loras]
    indiv_test = [tl.metrics["test_acc"] for tl in loras]
    info: dict[str, Any] = {"tasks": list(tasks), "individual_test_acc": dict(zip(tasks, indiv_test)),
                            "individual_val_acc": dict(zip(tasks, indiv_val)), "lora_build_s": t_train,
                            "chosen": {}, "test_acc": {}, "val_norm_acc": {}}
    table.add("individual LoRAs (reference)", "normalized acc", 1.0)
    table.add("individual LoRAs (reference)", "mean test acc", statistics.fmean(indiv_test))
    base_val = ev.accuracies(None, "val")
    info["individual_val_gain_points"] = {t: 100 * (a - b) for t, a, b in zip(tasks, indiv_val, base_val)}
    base = ev.accuracies(None, "test")
    table.add("no adapter (task heads)", "normalized acc", _norm_acc(base, indiv_test))
    table.add("no adapter (task heads)", "mean test acc", statistics.fmean(base))
    ranks: dict[str, int] = {}
    weighted: dict[str, list[float]] = {}
    for row, (build, knobs) in _methods(S.full_rows, seed, S.rank, S.drop_rate).items():
        if S.rows is not None and row not in S.rows:
            continue
        params, val_score = _tune(build, knobs, states, ev, indiv_val, S)
        merged = build(states, params["lam"], params["density"], params["beta"])
        hits = ev.hits(merged, "test")
        accs = [float(h.double().mean()) for h in hits]
        weighted[row] = _weighted_hits(hits, indiv_test)
        table.add(row, "normalized acc", _norm_acc(accs, indiv_test))
        table.add(row, "mean test acc", statistics.fmean(accs))
        table.add(row, "val normalized acc", val_score)
        if "reference" not in row:
            ranks[row] = _numerical_rank(merged)
            table.add(row, "max numerical rank", ranks[row])
        info["chosen"][row] = params
        info["test_acc"][row] = dict(zip(tasks, accs))
        info["val_norm_acc"][row] = val_score
    info["numerical_rank"] = ranks
    info["evaluations"] = ev.evals
    return {"table": table, "info": info, "weighted": weighted}


DRAW = "independent draw"


def _independent_draw(seed: int, S: CtmSettings, bert: nn.Module, tok: Any, base_memo: dict[Any, torch.Tensor]
                      ) -> dict[str, Any]:
    """The frozen quick rule on an independent draw: every task's LoRA for ``seed`` (trained and cached on first
    use), its validation gain over no adapter, :func:`quick_task_rule` on that one seed (at least 2 tasks: with
    fewer there is nothing to merge), then :func:`_measure` on the picked tasks with the same seed."""
    from rankwise.repro.kit.task_loras import TASKS, task_data, task_lora

    recipe = _recipe(S)
    loras = [task_lora(t, seed, recipe=recipe, bert=bert, tokenizer=tok, cache=S.recipe == "cached") for t in TASKS]
    ev = Evaluator(bert, tok, loras, [task_data(t, seed, recipe) for t in TASKS], recipe, base_memo)
    base_val = ev.accuracies(None, "val")
    gains = {t: [100 * (tl.metrics["val_acc"] - b)] for t, tl, b in zip(TASKS, loras, base_val)}
    n_train = {t: int(tl.metrics["n_train"]) for t, tl in zip(TASKS, loras)}
    min_gain = QUICK_MIN_VAL_GAIN if S.min_val_gain is None else S.min_val_gain
    passing = [t for t in TASKS if gains[t][0] >= min_gain]
    out: dict[str, Any] = {"seed": seed, "val_gain_points": {t: g[0] for t, g in gains.items()}, "passing": passing}
    if len(passing) < 2:
        out["tasks"] = []
        return out
    tasks = quick_task_rule(gains, n_train, k=min(3, len(passing)), min_gain=min_gain)
    out["tasks"] = list(tasks)
    out["run"] = _measure(seed, dataclasses.replace(S, tasks=tasks), bert, tok, base_memo)
    return out


class CtmReproduction(MiniLMReproduction):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    columns = COLUMNS
    column_notes = COLUMN_NOTES

    def running(self) -> Any:
        from rankwise.repro.kit.task_loras import shared_encodings

        return shared_encodings()  # each text list runs through the frozen prefix once per process

    def measure(self, settings: CtmSettings, seed: int) -> dict[str, Any]:
        if not hasattr(self, "_base_memo"):  # one memo of the base embeddings shared by every seed
            self._base_memo: dict[Any, torch.Tensor] = {}
        bert, tok = self.minilm()  # one load shared by every seed
        return _measure(seed, settings, bert, tok, self._base_memo)

    def measure_joint(self, settings: CtmSettings, records: Records[dict]) -> dict[str, Any] | None:
        if settings.confirm_seed is None:
            return None
        bert, tok = self.minilm()
        return _independent_draw(settings.confirm_seed, settings, bert, tok, self._base_memo)

    def table(self, settings: CtmSettings, records: Records[dict]) -> Table:
        table = super().table(settings, records)
        draw = records.joint
        if draw and draw.get("run"):
            prefix = f"[{DRAW}, seed {draw['seed']}: {', '.join(draw['tasks'])}] "
            for row, cols in draw["run"]["table"].rows.items():
                if row in ("CtM-TIES", "MtC-TIES (PEFT ties_svd)", "individual LoRAs (reference)",
                           "no adapter (task heads)"):
                    for col, vals in cols.items():
                        for v in vals:
                            table.add(prefix + row, col, v)
        return table

    def _gaps(self, records: Records[dict]) -> dict[int, float]:
        ctm = self._table.values("CtM-TIES", "normalized acc")
        mtc = self._table.values("MtC-TIES (PEFT ties_svd)", "normalized acc")
        return {s: 100 * (ctm[i] - mtc[i]) for i, s in enumerate(records.seeds)}

    def preconditions(self, settings: CtmSettings, records: Records[dict]) -> list[Precondition]:
        t = self._table
        out = [Precondition("the individual LoRAs (upper bound) beat no adapter (lower bound): mean test accuracy "
                            "individual LoRAs - no adapter",
                            t.mean("individual LoRAs (reference)", "mean test acc")
                            - t.mean("no adapter (task heads)", "mean test acc"), ">", 0.0, unit="acc")]
        if settings.min_val_gain is not None:
            gains = [statistics.fmean(r["info"]["individual_val_gain_points"][task] for r in records)
                     for task in _tasks(settings)]
            out.append(Precondition("quick mode's task rule on this run's seeds: min over tasks of the LoRA's mean "
                                    "validation gain over no adapter (points)", min(gains), ">=",
                                    settings.min_val_gain))
        draw = records.joint
        if draw is not None:
            out.append(Precondition(f"the {DRAW} (seed {draw['seed']}) has tasks to merge: tasks whose LoRA passes "
                                    "the frozen rule on validation", len(draw["passing"]), ">=", 2, unit="tasks"))
        return out

    def checks(self, settings: CtmSettings, records: Records[dict]) -> list[ClaimCheck]:
        S, t = settings, self._table
        gaps = self._gaps(records)
        mean_gap = statistics.fmean(gaps.values())
        samples = [[a - b for a, b in zip(r["weighted"]["CtM-TIES"], r["weighted"]["MtC-TIES (PEFT ties_svd)"])]
                   for r in records]
        max_rank = max(v for r in records for row, v in r["info"]["numerical_rank"].items() if row in CTM_ROWS)
        checks = [
            ClaimCheck("CtM-TIES - MtC-TIES (full space, PEFT ties_svd): mean normalized accuracy over seeds",
                       mean_gap, ">=", MARGIN_REDUCED if S.reduced_claim else MARGIN_FULL, unit="points",
                       note="the spec's quick-mode claim is the reduced '>= -0.5 point'" if S.reduced_claim else "",
                       samples=samples),
            ClaimCheck(f"every CtM output has numerical rank <= {S.rank} per layer (max over layers, seeds, CtM rows)",
                       max_rank, "<=", S.rank, unit="rank", kind="wiring"),
        ]
        draw = records.joint
        if draw is not None and draw.get("run"):
            w = draw["run"]["weighted"]
            d = [a - b for a, b in zip(w["CtM-TIES"], w["MtC-TIES (PEFT ties_svd)"])]
            checks.insert(1, ClaimCheck(
                f"{DRAW}: CtM-TIES - MtC-TIES on the tasks the frozen rule picks on seed {draw['seed']} "
                f"({', '.join(draw['tasks'])}; validation only): normalized accuracy", statistics.fmean(d), ">=",
                MARGIN_REDUCED if S.reduced_claim else MARGIN_FULL, unit="points",
                note="confirms the quick task rule, written after a failing result, on tasks and LoRAs it never saw",
                samples=[d]))
        if not S.reduced_claim:
            best_ctm = max(t.mean(r, "normalized acc") for r in CTM_ROWS)
            best_base = max(t.mean(r, "normalized acc") for r in TRUNCATED_BASELINES if r in t.rows)
            checks.insert(1, ClaimCheck("best CtM variant - best truncated baseline (mean normalized accuracy)",
                                        100 * (best_ctm - best_base), ">=", 0.0, unit="points"))
        return checks

    def figures(self, settings: CtmSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return _figure(self._table, out_dir, settings.rank)

    def notes(self, settings: CtmSettings, records: Records[dict]) -> str:
        S, table = settings, self._table
        recipe, tasks = _recipe(S), list(_tasks(S))
        per_seed = [r["info"] for r in records]
        gaps = self._gaps(records)
        build_s = sum(s["lora_build_s"] for s in per_seed)
        val_gains = {t: [round(s["individual_val_gain_points"][t], 1) for s in per_seed] for t in tasks}
        lora_gain = (table.mean("individual LoRAs (reference)", "mean test acc")
                     - table.mean("no adapter (task heads)", "mean test acc"))
        return (
            f"T = {len(tasks)} zoo text tasks ({', '.join(tasks)}); one LoRA (rank {recipe['rank']}, alpha "
            f"{recipe['alpha']}) per task on q/k/v/attention.output.dense of the top {recipe['top_layers']} MiniLM "
            f"layers ({recipe['epochs']} epochs, Adam; rankwise.repro.kit.task_loras, cached after the first run: this "
            f"run spent {build_s:.1f} s loading or training them). Merged rank r = {S.rank} (= the LoRA rank, as in "
            f"the paper). Tuning on each task's held-out validation split ({recipe['n_val']} examples): λ in "
            f"{list(S.lambdas)} at topK {S.density0:.0%} and β {S.beta0}"
            + (f", then topK in {list(S.topks)}, then (CtM) β in {list(S.betas)}" if S.topks else
               " (topK and β fixed in this mode)")
            + f"; DARE drop rate {S.drop_rate}. Full-space baselines are PEFT's own add_weighted_adapter (svd, ties_svd"
            + (", dare_ties_svd" if S.full_rows else "") + f", svd_rank={S.rank}). Deviations from the spec: the "
            "spec's synthetic template tasks are replaced by the zoo's docstring tasks; LoRAs adapt the top "
            f"{recipe['top_layers']} layer(s) only (not all 6, so that the training and about 100 evaluations per seed "
            "fit the time budget) and are trained by one recipe shared by quick and full mode so that the cached LoRAs "
            "serve both"
            + (f"; quick mode's tasks are those whose LoRA beats no adapter by >= {S.min_val_gain:g} points of "
               "validation accuracy (mean of seeds 0, 1; a precondition of a merge comparison, chosen without looking "
               "at any merge row or test number). " if S.min_val_gain is not None else ". ") +
            f"Validation gain of each LoRA over no adapter this run (points): {val_gains}. " +
            self._draw_note(records) +
            f"Per-seed CtM-TIES - MtC-TIES gap (points): { {k: round(v, 2) for k, v in gaps.items()} }; its interval "
            "is a paired bootstrap over the test examples of all tasks (each weighted by 1 / (T n_t r_t)). "
            f"The individual LoRAs' mean test accuracy is {100 * lora_gain:+.1f} points above the base encoder's with "
            "the same task heads (row 'no adapter'): the smaller this is, the less room the merges have to differ. "
            f"At this scale (T <= 6, rank {S.rank}, {recipe['top_layers']} adapted layer(s)) the gap is expected to be "
            "small: the paper's argument is that full-space merging spreads energy over up to T r directions which "
            "truncation then cuts; with few, small tasks that loss is limited.")

    @staticmethod
    def _draw_note(records: Records[dict]) -> str:
        draw = records.joint
        if draw is None:
            return ""
        g = {t: round(v, 1) for t, v in draw["val_gain_points"].items()}
        if not draw.get("run"):
            return (f"Independent draw (seed {draw['seed']}): validation gains {g}; fewer than 2 tasks pass the frozen "
                    "rule, so nothing is merged and the verdict is inconclusive. ")
        w = draw["run"]["weighted"]
        gap = statistics.fmean(a - b for a, b in zip(w["CtM-TIES"], w["MtC-TIES (PEFT ties_svd)"]))
        return (f"Independent draw (the frozen quick rule on seed {draw['seed']}'s own LoRAs, validation only): gains "
                f"{g}; the rule picks {', '.join(draw['tasks'])}; CtM-TIES - MtC-TIES there: {gap:+.2f} points. ")

    def config(self, settings: CtmSettings, records: Records[dict]) -> dict[str, Any]:
        return {"tasks": list(_tasks(settings)), "recipe": _recipe(settings)}

    def extra(self, settings: CtmSettings, records: Records[dict]) -> dict[str, Any]:
        out = {"seeds": {str(s): r["info"] for s, r in records.items()},
               "gap_ctm_ties_vs_mtc_ties_points": {str(s): g for s, g in self._gaps(records).items()}}
        draw = records.joint
        if draw is not None:
            out["independent_draw"] = {k: v for k, v in draw.items() if k != "run"}
            if draw.get("run"):
                out["independent_draw"]["info"] = draw["run"]["info"]
        return out


def _figure(table: Table, out_dir: Path, rank: int = RANK) -> list[str]:
    plt = pyplot()
    rows = list(table.rows)
    means = [100 * table.mean(r, "normalized acc") for r in rows]
    stds = [100 * table.std(r, "normalized acc") for r in rows]
    colors = ["tab:red" if r.startswith("CtM") else "tab:gray" if "reference" in r or "no adapter" in r
              else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh(rows, means, xerr=stds, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel(f"mean normalized accuracy (%) of one merged LoRA (rank {rank})")
    ax.set_xlim(max(0.0, min(means) - 10), max(means) + 5)
    ax.set_title("Merging task LoRAs on MiniLM: CtM (red) vs merge-then-compress (blue)")
    fig.tight_layout()
    return [save_figure(fig, out_dir / "ctm_normalized_accuracy.png", dpi=120)]


REPRODUCTION = CtmReproduction
run = CtmReproduction.run
