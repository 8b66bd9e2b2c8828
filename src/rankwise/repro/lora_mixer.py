"""Reproduction of LoRA-Mixer (routed LoRA experts in the attention projections, Routing Specialization Loss).

Setting (spec "Reproduction at small scale", adapted to the zoo): the pretrained all-MiniLM-L6-v2
frozen, LoRA-Mixer experts (r = 4, one per task) on query/key/value/attention.output.dense of the top
``top_layers`` blocks (the blocks below are run once and cached), mean-pooled tokens -> ONE shared
linear head over the union label space of ``T`` zoo docstring tasks. The zoo's tasks label the same
docstrings in different ways, so a task cannot be told from the text alone: every text carries a task
tag (``"[t01] ..."``); the routers still never receive the task id, they must learn it from the
token representations.

Regime (i), hard-soft (Sec. 3.2-3.3):
  stage 1: hard routing — each training example goes to the expert of its task; experts and head train
  (Adam 1e-3 for the experts as in the spec, 1e-2 for the head as in every row that trains a head,
  batch 32); stage 2: the head and experts frozen, routers only (Adam 1e-2, 5 epochs, batch
  16) on a small mixed routing set (16/32/64 examples per task), soft fusion, with the task loss plus
  the aux loss only (Eq. 3), the RSL (default sign, entropy lowered) or the RSL as printed (sign -1);
  inference keeps the top K = 2 experts (``K = E`` gives the dense row).
Regime (ii), plug-and-play (Sec. 4.3): per-task LoRAs (rankwise's reference LoRA, r = 4) trained
  independently, each on its own task with a shared head that was trained first on the frozen encoder;
  they are loaded as frozen experts and only the routers train (same stage-2 recipe).
Baselines: one multi-task LoRA r = 16 on the same projections (PEFT), trained on all tasks for the same
number of steps as stage 1; full mode adds an FFN-placed top-2 MoE-LoRA (E experts on
intermediate.dense and output.dense, trained jointly with the aux loss, MixLoRA-style); the oracle
(test examples hard-routed to their task's expert) and, in regime (ii), the uniform mixture of the LoRAs.

Claims (every mode; quick: T = 2, regime (i) only, no multi-task LoRA row, plus the two exact wiring
identities on the first seed: new experts leave the model unchanged, top-K fusion with K = E equals soft
fusion): the per-token routing entropy falls during stage 2 with the default sign (mean over seeds), and
(full: T = 4, 3 seeds; 32 routing examples per task): (a) RSL accuracy >= aux-only + 1 point; (b) every
expert's global top-1 load in [0.5/E, 2/E]; (c) each task's most-used expert has per-task load
>= 1.5/E, and I(task; top-1 expert) with RSL >= aux-only + 0.05 nats; (d) LoRA-Mixer's trainable
parameters <= 0.6 x the FFN-placed MoE-LoRA's at equal E, r. The printed-sign variant is reported
without a pass/fail margin.

Settings (:class:`LoRAMixerSettings`, ``SETTINGS[mode]``; ``rankwise reproduce lora_mixer --set epochs1=3``): the
model and its adapted blocks and projections, the tasks, the data sizes, both stages' budgets, the experts'
shape, the learning rates and the optional rows.

Issue 14 (the review found that quick mode checked only the two identities and an entropy change, i.e. nothing
the paper claims, and that a head trained with the experts can carry the accuracy): the head is now fitted
first as a linear probe on the frozen encoder and then *fixed* (``head="probe"``; ``head="trained"`` restores
the old protocol), so accuracy beyond the probe comes from the experts, and the probe is the head-only row;
quick mode runs (a)-(d) at T = 2. Preconditions added: the experts matter (oracle above the probe) and the
tasks do not saturate (best row below 0.99).

Check kinds: the two exact identities of quick and smoke are ``wiring``; the entropy change, (a)-(d) are
``claim`` checks; (a) carries paired per-example samples (each test example's correctness difference RSL -
aux only, weighted by ``N / (T n_task)`` so their mean is the mean-over-tasks accuracy difference), so its
bootstrap interval is reported. Precondition (stated before any run; its floor is chance, not a tuned
number, and it can move a verdict to ``inconclusive``): stage 1 trained the experts, i.e. the oracle
(test examples hard-routed to their task's expert) has a mean accuracy above the mean over tasks of
1 / (labels of the task); without it the routers have nothing to specialise on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.adapt import lora, lora_mixer
from rankwise.repro.kit.cached_encoder import (CachedSplit, FrozenPrefix, TopModel, fit_probe_head, peft_inject,
                                               trim_padding as _trim)
from rankwise.repro.mtlora import (TextCache, adapter_params, epoch_batches, length_order, multitask_data,
                                   per_task_accuracy, weighted_differences)
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting

ID = "lora_mixer"
CLAIM = ("Routing LoRA experts inside the attention projections, trained with the Routing Specialization Loss, "
         "gives balanced yet task-specialised routing and better multi-task accuracy than the plain auxiliary "
         "balance loss, with fewer trainable parameters than FFN-placed MoE-LoRA.")

TARGETS = ("query", "key", "value", "attention.output.dense")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAMixerSettings(Settings):
    """What the LoRA-Mixer reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    model: str = setting("all-MiniLM-L6-v2", "the frozen pretrained encoder (zoo.minilm)", choices=("all-MiniLM-L6-v2",))
    top_layers: int = setting(2, "adapted top encoder blocks (the blocks below are cached)", lo=1, hi=6)
    targets: tuple[str, ...] = setting(TARGETS, "projections that carry the LoRA-Mixer experts (and the multi-task "
                                       "LoRA / per-task LoRAs)")
    tasks: tuple[str, ...] = setting(("topic", "raises"), "zoo text tasks (one expert per task: E = T)")
    max_train: int | None = setting(192, "training examples per task (None: all)", lo=1)
    max_test: int | None = setting(100, "test examples per task (None: all)", lo=1)
    max_length: int = setting(32, "tokens per text", lo=1)
    epochs1: int = setting(2, "stage-1 epochs (experts + head, hard routing by task)", lo=1)
    batch1: int = setting(32, "stage-1 batch size", lo=1)
    route_sizes: tuple[int, ...] = setting((32,), "routing-set sizes, examples per task (stage 2)", lo=1)
    route_epochs: int = setting(5, "stage-2 epochs over the routing set (routers only)", lo=1)
    batch2: int = setting(16, "stage-2 batch size", lo=1)
    rank: int = setting(4, "expert rank (every row's LoRA rank except the multi-task LoRA's 16)", lo=1)
    alpha: float = setting(8.0, "expert alpha", lo=0.0)
    top_k: int = setting(2, "experts kept at inference (top-K; min(top_k, E))", lo=1)
    lr_stage1: float = setting(1e-3, "stage-1 learning rate of the experts (and every trained adapter)", lo=0.0)
    lr_router: float = setting(1e-2, "stage-2 learning rate of the routers", lo=0.0)
    lr_head: float = setting(1e-2, "learning rate of the head (every row that trains one)", lo=0.0)
    wiring_checks: bool = setting(True, "check the two exact identities (zero at init, top-K with K = E = soft "
                                        "fusion) on the first seed")
    plug_and_play: bool = setting(False, "also run regime (ii), routers over independently trained per-task LoRAs")
    lora_baseline: bool = setting(False, "also run the multi-task LoRA r=16 baseline (PEFT)")
    ffn_moe: bool = setting(False, "also run the FFN-placed top-2 MoE-LoRA (MixLoRA-style)")
    head: str = setting("probe", "probe: the head is fitted first as a linear probe on the frozen encoder and then "
                        "fixed for every row (accuracy then comes from the experts; the probe is the head-only row); "
                        "trained: stage 1 and the baselines train the head (lr_head)", choices=("probe", "trained"))
    probe_steps: int = setting(300, "full-batch Adam steps of the probe head (head=probe)", lo=1)
    probe_lr: float = setting(1e-2, "learning rate of the probe head (head=probe)", lo=0.0)

    def validate(self) -> None:
        if len(self.tasks) < 2:
            raise ValueError(f"LoRAMixerSettings.tasks must name at least 2 tasks, got {self.tasks!r}")
        if not self.route_sizes:
            raise ValueError("LoRAMixerSettings.route_sizes must not be empty")


SETTINGS: dict[str, LoRAMixerSettings] = {
    "smoke": LoRAMixerSettings(max_train=32, max_test=16, top_layers=1, epochs1=1, route_sizes=(4,), route_epochs=1,
                               batch1=16, batch2=8, plug_and_play=True, lora_baseline=True),
    # quick (checks: the two exact invariants, on the first seed, and the entropy change in stage 2): regime (ii)
    # and the multi-task LoRA baseline, which no quick check uses, run in smoke (wiring) and full only. Stage 1 keeps
    # 2 epochs (the spec's quick has 1 of 600 examples per task; 1 epoch of 192 here leaves the experts untrained:
    # oracle accuracy 0.55 vs 0.65)
    # One seed, as the spec's quick mode (two seeds took 63 s on an idle 2-core machine, over the 60 s budget).
    "quick": LoRAMixerSettings(seeds=(0,)),
    # full: the two exact wiring checks of quick (zero at init, top-K with K = E = soft fusion) are not repeated
    "full": LoRAMixerSettings(tasks=("topic", "kind", "raises", "length"), max_train=200, epochs1=3,
                              route_sizes=(16, 32, 64), ffn_moe=True, wiring_checks=False, plug_and_play=True,
                              lora_baseline=True),
}
CLAIM_ROUTE = 32           # routing examples per task for the claims (the spec's)
ACC_MARGIN = 0.01          # (a) RSL >= aux + 1 point
LOAD_LOW, LOAD_HIGH = 0.5, 2.0   # (b) global top-1 load in [0.5/E, 2/E]
PEAK_LOAD = 1.5            # (c) per-task most-used expert >= 1.5/E
MI_MARGIN = 0.05           # (c) I(task; expert) RSL - aux >= 0.05 nats
PARAM_RATIO = 0.6          # (d)
SATURATED = 0.99           # precondition: the best row's mean accuracy below 0.99 (not within a point of 100 %)

VARIANTS = {  # name -> (rsl_lambda, entropy_sign); rsl_alpha 0.01 in all
    "aux only (Eq. 3)": (0.0, 1),
    "RSL": (0.01, 1),
    "RSL printed sign (-1)": (0.01, -1),
}


# ------------------------------------------------------------------------------------------------
# training and measuring
# ------------------------------------------------------------------------------------------------

def _train(model: nn.Module, split: CachedSplit, indices: list[torch.Tensor], lr: float, seed: int, *,
           task_of: Sequence[int] | None = None, extra: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
           grad_clip: float = 1.0, lr_head: float | None = None) -> list[float]:
    """Adam on the trainable parameters (the head at ``lr_head`` when given); hard routing by ``task_of``
    when given; loss CE (+ ``extra``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    head = [p for n, p in named if n.startswith("classifier")]
    rest = [p for n, p in named if not n.startswith("classifier")]
    groups = [{"params": rest, "lr": lr}, {"params": head, "lr": lr if lr_head is None else lr_head}]
    opt = torch.optim.Adam([g for g in groups if g["params"]], lr=lr)
    losses = []
    for step, (idx, b) in enumerate(zip(indices, split.batches(indices))):
        model.train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100_003 + step)
            ctx = (lora_mixer.hard_routing(model, torch.tensor([task_of[int(i)] for i in idx]))
                   if task_of is not None else contextlib.nullcontext())
            with ctx:
                logits = model(**b.inputs)
            loss = nn.functional.cross_entropy(logits, b.labels)
            if extra is not None:
                loss = loss + extra(model, b.inputs["attention_mask"])
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def _measure(model: nn.Module, split: CachedSplit, task_of: Sequence[int], n_tasks: int, *,
             fusion: str | None = None, hard: bool = False, chunk: int = 64) -> dict[str, Any]:
    """Accuracy per task and routing statistics (top-1 expert of every real token, per layer) in eval mode.

    Examples run in chunks of similar length (:func:`rankwise.repro.mtlora.length_order`); the logits come
    back in the original order (the routing statistics are counts, independent of the order).
    """
    was = model.training
    model.eval()
    logits, top1, token_task = [], None, []
    mixers = lora_mixer.mixer_layers(model) if not hard else []
    ctx = lora_mixer.fusion(model, fusion) if fusion and lora_mixer.mixer_layers(model) else contextlib.nullcontext()
    order = length_order(split.mask)
    all_tasks = torch.tensor(list(task_of))
    try:
        with ctx:
            for r in order.split(chunk):
                h, m = _trim(split.hidden[r], split.mask[r])
                tasks = all_tasks[r]
                hctx = lora_mixer.hard_routing(model, tasks) if hard else contextlib.nullcontext()
                with hctx:
                    logits.append(model(h, m))
                if mixers:
                    stats = lora_mixer.routing_stats(model, m)
                    t1 = torch.stack([s["top1"] for s in stats])            # (layers, tokens)
                    top1 = t1 if top1 is None else torch.cat([top1, t1], 1)
                    token_task.append(tasks[:, None].expand_as(m)[m.bool()])
    finally:
        model.train(was)
    out_logits = torch.cat(logits)[order.argsort()]
    acc = per_task_accuracy(out_logits, split.labels, task_of, n_tasks)
    res: dict[str, Any] = {"per_task": acc, "mean_acc": statistics.fmean(acc), "logits": out_logits}
    if top1 is not None:
        res.update(routing_summary(top1, torch.cat(token_task), n_tasks, int(mixers[0][1].mixer[
            mixers[0][1].active_adapters[0]].num_experts)))
    return res


def routing_summary(top1: torch.Tensor, token_task: torch.Tensor, n_tasks: int, n_experts: int) -> dict[str, Any]:
    """From top-1 experts ``(layers, tokens)`` and each token's task: global load per expert (pooled over
    layers), the per-task load matrix ``(tasks, experts)``, and I(task; top-1 expert) in nats (mean over layers)."""
    L = top1.shape[0]
    tt = token_task[None].expand(L, -1)
    joint = torch.zeros(L, n_tasks, n_experts, dtype=torch.float64)
    joint.view(L, -1).scatter_add_(1, (tt * n_experts + top1).contiguous(),
                                   torch.ones(top1.shape, dtype=torch.float64))
    joint = joint / joint.sum((1, 2), keepdim=True)
    pt, pe = joint.sum(2, keepdim=True), joint.sum(1, keepdim=True)
    mi = torch.where(joint > 0, joint * (joint / (pt * pe)).log(), torch.zeros_like(joint)).sum((1, 2))
    pooled = joint.mean(0)
    load = pooled.sum(0)
    per_task = pooled / pooled.sum(1, keepdim=True)
    return {"global_load": load.tolist(), "task_load": per_task.tolist(), "mi": float(mi.mean()),
            "mi_per_layer": mi.tolist()}


@torch.no_grad()
def _route_entropy(model: nn.Module, split: CachedSplit) -> float:
    """Mean normalised per-token routing entropy (soft routing) over the layers, on a cached set."""
    was = model.training
    model.eval()
    try:
        vals = []
        with lora_mixer.fusion(model, "soft"):
            for i in range(0, len(split.labels), 200):
                h, m = _trim(split.hidden[i:i + 200], split.mask[i:i + 200])
                model(h, m)
                vals.append(statistics.fmean(s["entropy"] for s in lora_mixer.routing_stats(model, m)))
    finally:
        model.train(was)
    return statistics.fmean(vals)


def _freeze_all_but(model: nn.Module, pred: Callable[[str], bool]) -> None:
    for n, p in model.named_parameters():
        p.requires_grad_(pred(n))


# ------------------------------------------------------------------------------------------------
# one seed
# ------------------------------------------------------------------------------------------------

def _run_seed(seed: int, S: "LoRAMixerSettings", bert: nn.Module, prefix: TextCache, first_seed: bool = True
              ) -> dict[str, Any]:
    T = len(S.tasks)
    train, test, tr_task, te_task, offsets = multitask_data(S.tasks, seed, S.max_train, S.max_test)
    idx1 = epoch_batches(len(train), S.epochs1, S.batch1, seed)
    # routing sets: the first n examples of each task in the (shuffled) training order, nested across sizes
    route_idx: dict[int, list[int]] = {}
    for n in S.route_sizes:
        seen = [0] * T
        pick = []
        for i, t in enumerate(tr_task):
            if seen[t] < n:
                seen[t] += 1
                pick.append(i)
        route_idx[n] = pick
    idx2 = {n: [torch.tensor(pick)[b] for b in epoch_batches(len(pick), S.route_epochs, min(S.batch2, len(pick)),
                                                               seed + 7)] for n, pick in route_idx.items()}
    split = CachedSplit(prefix, train, keep_all=True)
    test_split = CachedSplit(prefix, test, keep_all=True)
    base = TopModel(bert, S.top_layers, offsets[-1], seed)
    probe = (fit_probe_head(base, split.hidden, split.mask, split.labels, steps=S.probe_steps, lr=S.probe_lr)
             if S.head == "probe" else None)
    train_head = S.head == "trained"
    cfg = lora_mixer.LoRAMixerConfig(num_experts=T, rank=S.rank, alpha=S.alpha, dropout=0.1, top_k_infer=min(S.top_k, T),
                                     seed=seed)
    out: dict[str, Any] = {"n_train": len(train), "n_test": len(test), "stage1_steps": len(idx1), "rows": {},
                           "labels": [offsets[t + 1] - offsets[t] for t in range(T)], "test_task": list(te_task)}

    # ---------------- regime (i): stage 1, hard routing by task ----------------
    mixer = lora_mixer.adapt(copy.deepcopy(base), cfg, target=S.targets)
    out["init_max_abs_diff"] = out["topk_KE_vs_soft_max_abs_diff"] = None
    wiring = S.wiring_checks and first_seed   # exact code-path identities: checked on the first seed
    if wiring:
        base_logits = _measure(base, test_split, te_task, T)["logits"]
        out["init_max_abs_diff"] = float((_measure(mixer, test_split, te_task, T)["logits"] - base_logits
                                          ).abs().max())
    lora_mixer.set_stage(mixer, "experts")
    mixer.classifier.requires_grad_(train_head)   # a probe head stays fixed
    _train(mixer, split, idx1, S.lr_stage1, seed, task_of=tr_task, lr_head=S.lr_head)
    out["rows"]["oracle: hard routing by task"] = _strip(_measure(mixer, test_split, te_task, T, hard=True))
    if probe is not None:   # the fixed head on the frozen encoder: what the experts start from
        out["rows"][HEAD_ROW] = _strip(_measure(base, test_split, te_task, T))
        out["rows"][HEAD_ROW]["probe_train_acc"] = probe["train_acc"]
    out["params_mixer"] = sum(p.numel() for n, p in mixer.named_parameters() if "mixer" in n)

    # ---------------- stage 2: routers only ----------------
    entropy_curve: dict[str, Any] = {}
    claim_n = _claim_size(S)
    for n, idx in idx2.items():
        rsplit_rows = route_idx[n]
        rsplit = _Subset(split, rsplit_rows)
        h0 = None   # the entropy before stage 2 is that of the same untrained routers for every variant
        for vname, (lam, sign) in VARIANTS.items():
            if n != claim_n and vname == "RSL printed sign (-1)":
                continue
            m = copy.deepcopy(mixer)
            lora_mixer.set_stage(m, "router")
            _freeze_all_but(m, lambda name: "router" in name)
            if h0 is None:
                h0 = _route_entropy(m, rsplit)

            def extra(model: nn.Module, mask: torch.Tensor, lam: float = lam, sign: int = sign) -> torch.Tensor:
                return lora_mixer.rsl_loss(model, mask, rsl_alpha=0.01, rsl_lambda=lam, entropy_sign=sign)

            _train(m, split, idx, S.lr_router, seed, extra=extra)
            h1 = _route_entropy(m, rsplit)
            key = f"LoRA-Mixer {vname}" + ("" if n == claim_n else f" @{n}/task")
            row = _strip(_measure(m, test_split, te_task, T))
            row.update(entropy_before=h0, entropy_after=h1, params=adapter_params(m))
            out["rows"][key] = row
            entropy_curve[key] = (h0, h1)
            if n == claim_n and vname == "RSL":
                dense = _strip(_measure(m, test_split, te_task, T, fusion="soft"))
                dense.update(params=adapter_params(m))
                out["rows"]["LoRA-Mixer RSL dense (K=E)"] = dense
                if wiring:   # K = E through the inference path equals soft fusion exactly
                    kE = copy.deepcopy(m)
                    for _, layer in lora_mixer.mixer_layers(kE):
                        for c in layer.adapter_config.values():
                            c["top_k_infer"] = T
                    out["topk_KE_vs_soft_max_abs_diff"] = float(
                        (_measure(kE, test_split, te_task, T)["logits"] - dense["_logits"]).abs().max())
    for r in out["rows"].values():
        logits = r.pop("_logits", None)
        if logits is not None:  # each test example's correctness (the claim's paired samples)
            r["_hits"] = (logits.argmax(-1) == test_split.labels).double().tolist()

    # ---------------- baselines ----------------
    import peft

    if S.lora_baseline:
        lo = peft_inject(copy.deepcopy(base), peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1,
                                                               target_modules=list(S.targets)))
        lo.classifier.requires_grad_(train_head)
        _train(lo, split, idx1, S.lr_stage1, seed, lr_head=S.lr_head)
        row = _strip(_measure(lo, test_split, te_task, T))
        row.update(params=adapter_params(lo))
        out["rows"]["multi-task LoRA r=16 (PEFT)"] = row
    ffn_cfg = lora_mixer.LoRAMixerConfig(num_experts=T, rank=S.rank, alpha=S.alpha, dropout=0.1, top_k_infer=min(2, T),
                                         seed=seed)
    ffn = lora_mixer.adapt(copy.deepcopy(base), ffn_cfg, target=("re:.*\\.intermediate\\.dense",
                                                                                    "re:.*\\.\\d+\\.output\\.dense"))
    out["params_ffn_moe"] = sum(p.numel() for n, p in ffn.named_parameters() if "mixer" in n)
    if S.ffn_moe:
        ffn.classifier.requires_grad_(train_head)
        _train(ffn, split, idx1, S.lr_stage1, seed, lr_head=S.lr_head,
               extra=lambda model, mask: lora_mixer.rsl_loss(model, mask, rsl_lambda=0.0))
        row = _strip(_measure(ffn, test_split, te_task, T))
        row.update(params=adapter_params(ffn))
        out["rows"]["FFN top-2 MoE-LoRA + aux (MixLoRA-style)"] = row

    out["entropy"] = entropy_curve
    if S.plug_and_play:
        _plug_and_play(out, S, seed, base, cfg, split, test_split, tr_task, te_task, idx1, idx2[claim_n])
    return out


def _plug_and_play(out: dict[str, Any], S: "LoRAMixerSettings", seed: int, base: nn.Module,
                   cfg: lora_mixer.LoRAMixerConfig, split: CachedSplit, test_split: CachedSplit,
                   tr_task: Sequence[int], te_task: Sequence[int], head_batches: list[torch.Tensor],
                   route_batches: list[torch.Tensor]) -> None:
    """Regime (ii): routers over independently trained frozen per-task LoRAs; adds its rows to ``out``."""
    T = len(S.tasks)
    head_model = copy.deepcopy(base)
    if S.head == "trained":   # with head=probe, base's head is already the shared head fitted on the frozen encoder
        _freeze_all_but(head_model, lambda name: name.startswith("classifier"))
        _train(head_model, split, head_batches, S.lr_head, seed)
    states = []
    for t in range(T):
        rows_t = [i for i, tt in enumerate(tr_task) if tt == t]
        lt = lora.adapt(copy.deepcopy(head_model), lora.LoraConfig(rank=S.rank, alpha=S.alpha, dropout=0.1,
                                                                   target=S.targets, seed=seed + t))
        # as many examples of its task as its expert saw in stage 1 (epochs1 passes over the task's data)
        idx_t = [torch.tensor(rows_t)[b] for b in epoch_batches(len(rows_t), S.epochs1,
                                                                min(S.batch1, len(rows_t)), seed + 100 + t)]
        _train(lt, split, idx_t, S.lr_stage1, seed)
        states.append(lora.get_state(lt))
    pp = lora_mixer.adapt(copy.deepcopy(head_model), cfg, target=S.targets, experts=states)
    out["rows"]["plug-and-play oracle (task -> its LoRA)"] = _strip(_measure(pp, test_split, te_task, T, hard=True))
    uni = copy.deepcopy(pp)
    with torch.no_grad():
        for _, layer in lora_mixer.mixer_layers(uni):
            for mx in layer.mixer.values():
                mx.router.zero_()
    row = _strip(_measure(uni, test_split, te_task, T, fusion="soft"))
    for k in ("global_load", "task_load", "mi", "mi_per_layer"):   # all-equal weights: no top-1 routing to report
        row.pop(k, None)
    out["rows"]["plug-and-play uniform mix (LoRAHub-style, w=1/E)"] = row
    for vname in ("aux only (Eq. 3)", "RSL"):
        lam, sign = VARIANTS[vname]
        m = copy.deepcopy(pp)
        _freeze_all_but(m, lambda name: "router" in name)

        def extra2(model: nn.Module, mask: torch.Tensor, lam: float = lam, sign: int = sign) -> torch.Tensor:
            return lora_mixer.rsl_loss(model, mask, rsl_alpha=0.01, rsl_lambda=lam, entropy_sign=sign)

        _train(m, split, route_batches, S.lr_router, seed, extra=extra2)
        row = _strip(_measure(m, test_split, te_task, T))
        row.update(params=adapter_params(m))
        out["rows"][f"plug-and-play {vname}"] = row


def _claim_size(S: "LoRAMixerSettings") -> int:
    """Routing examples per task of the claimed comparison: the spec's 32 when the mode uses it."""
    return CLAIM_ROUTE if CLAIM_ROUTE in S.route_sizes else S.route_sizes[0]


class _Subset:
    """A view of a CachedSplit restricted to some example indices (for measurements)."""

    def __init__(self, split: CachedSplit, rows: Sequence[int]) -> None:
        r = torch.tensor([split.row[i] for i in rows])
        self.hidden, self.mask, self.labels = split.hidden[r], split.mask[r], split.labels[r]


def _strip(res: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in res.items() if k != "logits"}
    out["_logits"] = res["logits"]
    return out


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------

ORACLE = "oracle: hard routing by task"
HEAD_ROW = "head only (probe, frozen encoder)"
RSL, AUX, PRINTED = "LoRA-Mixer RSL", "LoRA-Mixer aux only (Eq. 3)", "LoRA-Mixer RSL printed sign (-1)"


class LoRAMixerReproduction(Reproduction[LoRAMixerSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS

    def measure(self, S: LoRAMixerSettings, seed: int) -> dict[str, Any]:
        first = not hasattr(self, "prefix")  # measure runs in seed order: the first call is the first seed
        if first:
            from rankwise import zoo

            self.bert, tok = zoo.minilm()
            # every distinct text's frozen-prefix features are computed once for all seeds (the test set does not
            # depend on the seed; the seeds' training sets overlap)
            self.prefix = TextCache(FrozenPrefix(self.bert, tok, len(self.bert.encoder.layer) - S.top_layers,
                                                 S.max_length))
        return _run_seed(seed, S, self.bert, self.prefix, first_seed=first)

    def table(self, S: LoRAMixerSettings, records: Records[dict]) -> Table:
        T = len(S.tasks)
        cols = ["mean accuracy", "trainable params", "routing entropy (norm.)", "I(task; expert) nats",
                "min expert load x E", "max expert load x E", "min task-peak load x E"]
        table = Table(columns=cols, notes={
            "mean accuracy": "mean over tasks of the test accuracy (argmax over the union label space)",
            "trainable params": "parameters trained in the row's last stage (head excluded)",
            "routing entropy (norm.)": "after stage 2: mean over layers of the per-token H(p)/log E on the routing set",
            "I(task; expert) nats": "mutual information between a test token's task and its top-1 expert, mean over "
                                    "layers",
            "min expert load x E": "smallest global top-1 load (pooled over layers and test tokens) times E",
            "min task-peak load x E": "over tasks, the smallest load of the task's most-used expert, times E"})
        for res in records:
            for r, v in res["rows"].items():
                table.add(r, "mean accuracy", v["mean_acc"])
                if "params" in v:
                    table.add(r, "trainable params", v["params"])
                if "entropy_after" in v:
                    table.add(r, "routing entropy (norm.)", v["entropy_after"])
                if "mi" in v:
                    table.add(r, "I(task; expert) nats", v["mi"])
                    table.add(r, "min expert load x E", min(v["global_load"]) * T)
                    table.add(r, "max expert load x E", max(v["global_load"]) * T)
                    table.add(r, "min task-peak load x E", min(max(row) for row in v["task_load"]) * T)
        self._table = table
        return table

    def preconditions(self, S: LoRAMixerSettings, records: Records[dict]) -> list[Precondition]:
        chance = statistics.fmean(1.0 / k for k in records.first["labels"])
        oracle = self._table.mean(ORACLE, "mean accuracy")
        pre = [Precondition(f"stage 1 trained the experts: the oracle's mean accuracy - chance (mean over tasks of "
                            f"1 / labels = {chance:.3f})", oracle - chance, ">", 0.0)]
        if HEAD_ROW in records.first["rows"]:
            pre.append(Precondition("the experts matter: the oracle's mean accuracy - the fixed probe head's on the "
                                    "frozen encoder (else routing chooses between experts that add nothing)",
                                    oracle - self._table.mean(HEAD_ROW, "mean accuracy"), ">", 0.0))
        pre.append(Precondition("the tasks do not saturate: the best row's mean accuracy",
                                max(self._table.mean(r, "mean accuracy") for r in self._table.rows), "<", SATURATED))
        return pre

    def checks(self, S: LoRAMixerSettings, records: Records[dict]) -> list[ClaimCheck]:
        T, table = len(S.tasks), self._table
        d_ent = statistics.fmean(s["rows"][RSL]["entropy_after"] - s["rows"][RSL]["entropy_before"] for s in records)
        ratio = statistics.fmean(s["params_mixer"] / s["params_ffn_moe"] for s in records)
        loads = [x * T for s in records for x in s["rows"][RSL]["global_load"]]
        paired = [weighted_differences(s["rows"][RSL]["_hits"], s["rows"][AUX]["_hits"], s["test_task"])
                  for s in records]
        checks = []
        if S.wiring_checks:
            checks += [
                ClaimCheck("new experts (B = 0): max |logits(LoRA-Mixer) - logits(base)| on the test set (first seed)",
                           records.first["init_max_abs_diff"], "<=", 0.0, kind="wiring"),
                ClaimCheck("top-K fusion with K = E vs soft fusion: max |logits difference| on the test set (first "
                           "seed)", records.first["topk_KE_vs_soft_max_abs_diff"], "<=", 0.0, kind="wiring"),
            ]
        # issue 14: the claims (a)-(d) run in every mode (quick: T = 2, the claim's regime at a smaller size)
        return checks + [
            ClaimCheck("change of the normalised per-token routing entropy during stage 2 with RSL (default sign)",
                       d_ent, "<", 0.0),
            ClaimCheck("(a) mean accuracy RSL - aux only (32 routing examples per task), mean over seeds",
                       statistics.fmean(statistics.fmean(p) for p in paired), ">=", ACC_MARGIN, unit="acc",
                       samples=paired),
            ClaimCheck("(b) smallest global top-1 load x E with RSL (all experts, seeds)", min(loads), ">=",
                       LOAD_LOW),
            ClaimCheck("(b) largest global top-1 load x E with RSL (all experts, seeds)", max(loads), "<=",
                       LOAD_HIGH),
            ClaimCheck("(c) smallest per-task load of the task's most-used expert x E with RSL (mean over seeds)",
                       table.mean(RSL, "min task-peak load x E"), ">=", PEAK_LOAD),
            ClaimCheck("(c) I(task; top-1 expert): RSL - aux only, nats, mean over seeds",
                       table.mean(RSL, "I(task; expert) nats") - table.mean(AUX, "I(task; expert) nats"), ">=",
                       MI_MARGIN, unit="nats"),
            ClaimCheck("(d) LoRA-Mixer trainable parameters / FFN-placed MoE-LoRA's at equal E, r", ratio, "<=",
                       PARAM_RATIO),
        ]

    def figures(self, S: LoRAMixerSettings, records: Records[dict], out_dir: Path) -> list[str]:
        table = self._table
        plt = pyplot()
        rows = list(table.rows)
        fig, ax = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [2, 1, 1]})
        means = [table.mean(r, "mean accuracy") for r in rows]
        errs = [table.std(r, "mean accuracy") for r in rows]
        ax[0].barh(rows, means, xerr=errs, color="tab:blue")
        ax[0].set_xlabel("mean test accuracy over tasks")
        ax[0].tick_params(axis="y", labelsize=7)
        first = records.first["rows"]
        for a, key in zip(ax[1:], (AUX, RSL)):
            if key in first and "task_load" in first[key]:
                im = a.imshow(first[key]["task_load"], vmin=0, vmax=1, cmap="viridis")
                a.set_title(f"{key.replace('LoRA-Mixer ', '')}\nper-task top-1 load", fontsize=9)
                a.set_xlabel("expert")
                a.set_ylabel("task")
                fig.colorbar(im, ax=a, fraction=0.046)
        fig.tight_layout()
        return [save_figure(fig, out_dir / "lora_mixer_accuracy_routing.png", dpi=120)]

    def notes(self, S: LoRAMixerSettings, records: Records[dict]) -> str:
        T, table, first = len(S.tasks), self._table, records.first
        ratio = statistics.fmean(s["params_mixer"] / s["params_ffn_moe"] for s in records)
        printed = statistics.fmean(s["rows"][PRINTED]["mean_acc"] for s in records)
        ent = {k: statistics.fmean(s["rows"][k]["entropy_after"] - s["rows"][k]["entropy_before"] for s in records)
               for k in (RSL, AUX, PRINTED)}
        return (
            f"MiniLM top {S.top_layers} block(s) with LoRA-Mixer on {', '.join(S.targets)} (lower blocks cached; the "
            f"spec adapts all 6 in full mode, reduced for the time budget). Tasks: {', '.join(S.tasks)} from the zoo "
            f"(task-tagged texts because the zoo's tasks share docstrings; the spec's synthetic tasks were untagged), at "
            f"most {S.max_train} train / {S.max_test} test per task, {first['n_train']} training examples, "
            f"stage 1 {first['stage1_steps']} steps ({S.epochs1} epochs; the zoo tasks are smaller than the spec's "
            f"600/task), stage 2 routers only, {S.route_epochs} epochs, Adam {S.lr_router}, routing sets "
            f"{list(S.route_sizes)} examples per task. E = {T}, r = {S.rank}, alpha = {S.alpha}, "
            f"inference top-{min(S.top_k, T)}. "
            f"RSL: alpha 0.01 (with the factor E), lambda 0.01, f_bar = top-k slot share / k. Printed-sign RSL "
            f"(entropy_sign=-1), reported without a margin: mean accuracy {printed:.4f}. Entropy change in stage 2 "
            f"(normalised): RSL {ent[RSL]:+.4f}, aux {ent[AUX]:+.4f}, printed sign {ent[PRINTED]:+.4f}. "
            f"Parameter ratio LoRA-Mixer / FFN MoE-LoRA (equal E, r; counted): {ratio:.3f} — on a 384-wide BERT the "
            "FFN experts (384 <-> 1536) are only 1.25x the four 384x384 projections' experts, so the paper's ~48 % "
            "(which compares with MixLoRA's FFN experts plus its attention LoRAs on a 7B model) is not a property of "
            "placement alone. " + ("Regime (ii) (plug-and-play over frozen per-task LoRAs trained independently with a "
                                   "shared head) is reported in the table without a claim (the spec states none for "
                                   "it at this scale). " if S.plug_and_play else "Regime (ii) (plug-and-play) runs in "
                                   "full mode only (no quick check uses it). ") +
            f"I(task; top-1 expert): RSL {table.mean(RSL, 'I(task; expert) nats'):.3f}, aux only "
            f"{table.mean(AUX, 'I(task; expert) nats'):.3f} nats (at most log E = {math.log(T):.3f}). When (c) fails "
            "here, the reason to look at is the data: the tasks share their docstrings and differ only in the tag, so "
            "most tokens carry no task information and token-level routing can only specialise on the few that do; "
            "the entropy term then sharpens each token's routing without aligning it with tasks.")

    def config(self, S: LoRAMixerSettings, records: Records[dict]) -> dict[str, Any]:
        return {"claim_route_size": CLAIM_ROUTE}

    def extra(self, S: LoRAMixerSettings, records: Records[dict]) -> dict[str, Any]:
        return {"seeds": {s: {k: v for k, v in r.items() if k not in ("rows", "labels", "test_task")} | {"rows": {
            n: {k: v for k, v in row.items() if not k.startswith("_")} for n, row in r["rows"].items()}}
            for s, r in records.items()}}


REPRODUCTION = LoRAMixerReproduction
run = LoRAMixerReproduction.run
