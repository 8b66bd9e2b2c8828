"""Reproduction of VAPT (ICLR 2026, arXiv 2501.18936): input-adaptive deep prompts vs VPT-deep on a tiny ViT.

Backbone: the zoo's tiny ViT pretrained on the digits 0-4 (:func:`rankwise.zoo.pretrained_vit`, a cached
artefact built by ``rankwise zoo build``; 16 x 16 grey images, patch 4 -> a 4 x 4 grid, d = 64, L = 4), frozen.
Targets (VTAB-1k-like few-shot tasks, :func:`rankwise.zoo.digits_task` at 16 x 16): ``digits5to9`` (classes
never seen in pretraining), ``rot90`` (all ten digits rotated), ``inverted`` (all ten digits, 1 - x); ``shots``
training images per class drawn from the task's training split, the task's whole test split for testing.

Rows, each with a fresh classification head from the same seed, the same batches, AdamW at the same
learning rate with a cosine schedule over the same number of epochs (the spec's single budget for every
row; no per-row tuning):

* **linear probe**: the head only (trained on the frozen backbone's final [CLS] features, which is the
  same computation: the backbone has no dropout);
* **VPT-deep**: :func:`rankwise.adapt.vapt.apply_vapt` with ``method="vpt-deep"``, ``N_p`` prompts per layer;
* **VAPT**: ``method="vapt"``, the same ``N_p``, ``K``, ``h``, ``vpt_depth``;
* **full fine-tuning**: every parameter;
* **LoRA (PEFT)**: ``peft.LoraConfig`` on ``query``/``value`` (rank 2: 2,048 parameters, VPT-deep's count),
  ``modules_to_save=["classifier"]``.

Checks (thresholds fixed before any run; module constants):

(a) claim, the spec's headline: mean accuracy over the tasks VAPT - VPT-deep >= ``MARGIN_VPT`` (2 points),
    paired per test image (each task weighted equally), bootstrap interval over images and seeds;
(b) claim: VAPT adds fewer parameters than VPT-deep (ratio < 1);
(c) claim: VAPT beats the linear probe (mean accuracy difference > 0, paired);
(d) claim: VPT-deep beats the linear probe (> 0, paired);
(e)-(i) wiring: the generated prompts are exactly zero at initialisation; the sequence length is
    1 + N_p + N at every layer; the added parameters equal the spec's formula; the backbone is bit-identical
    after training; ``vpt_depth = L`` gives VPT-deep's logits exactly.

Preconditions: the linear probe learned (mean accuracy - chance > 0.10), and the tasks do not saturate
(the best row's mean accuracy < 0.99).

The paper's "beats full fine-tuning" result is not expected here (a 137k-parameter backbone pretrained for a
few seconds on 710 images) and is not a check; the table reports the full fine-tuning and LoRA rows.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.adapt import vapt
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting

ID = "vapt"
CLAIM = ("On a frozen pretrained ViT adapted to few-shot image tasks, VAPT (prompts generated from the previous "
         "layer's patch tokens) beats VPT-deep by at least 2 points of mean accuracy while adding fewer "
         "parameters, and both beat the linear probe.")

ROWS = ("linear probe", "VPT-deep", "VAPT", "full fine-tuning", "LoRA (PEFT)")
KEYS = ("probe", "vpt", "vapt", "full", "lora")

MARGIN_VPT = 0.02      # (a) VAPT - VPT-deep, mean accuracy over the tasks (the spec's 2.0 points)
MIN_ABOVE_CHANCE = 0.10  # precondition: the linear probe learned
MAX_SATURATION = 0.99  # precondition: the best row's mean accuracy stays below this
TOL_ZERO = 0.0         # (e) generated prompts at init: exactly zero


@dataclasses.dataclass(frozen=True, kw_only=True)
class VAPTSettings(Settings):
    """What the VAPT reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    backbone: str = setting("small", "the pretrained tiny ViT (zoo.pretrained_vit size)", choices=("small", "smoke"))
    tasks: tuple[str, ...] = setting(("digits5to9", "rot90", "inverted"), "target tasks (zoo.digits_task, 16x16)")
    shots: int = setting(30, "training images per class", lo=1)
    max_test: int | None = setting(None, "test images per task (None: the whole test split)", lo=1)
    epochs: int = setting(60, "epochs over the few-shot training set (every row)", lo=1)
    batch_size: int = setting(32, "images per step", lo=1)
    lr: float = setting(3e-3, "AdamW learning rate of every row (cosine decay to 0)", lo=0.0)
    weight_decay: float = setting(0.0, "AdamW weight decay of every row", lo=0.0)
    num_prompts: int = setting(8, "N_p, prompt tokens (VPT-deep and VAPT)", lo=1)
    kernel_size: int = setting(2, "K, VAPT's convolution kernel", lo=1)
    mlp_hidden: int = setting(4, "h, VAPT's feature projector width", lo=1)
    vpt_depth: int = setting(1, "layers with static prompts in VAPT", lo=1)
    lora_rank: int = setting(2, "PEFT LoRA rank on query/value", lo=1)
    lora_alpha: float = setting(4.0, "PEFT LoRA alpha", lo=0.0)


SETTINGS: dict[str, VAPTSettings] = {
    "smoke": VAPTSettings(backbone="smoke", tasks=("rot90",), shots=3, max_test=20, epochs=1, seeds=(0,)),
    # one task (the one furthest from the source: rotated digits), one seed, a third of the epochs
    "quick": VAPTSettings(tasks=("rot90",), epochs=20, seeds=(0,)),
    "full": VAPTSettings(epochs=30, seeds=(0, 1, 2)),
}


def _few_shot(task: Any, shots: int, max_test: int | None, seed: int) -> tuple[torch.Tensor, ...]:
    """``shots`` training images per class (seeded draw) and the first ``max_test`` test images."""
    g = torch.Generator().manual_seed(seed)
    idx = []
    for c in range(task.num_labels):
        pool = torch.nonzero(task.y_train == c).flatten()
        if len(pool) < shots:
            raise ValueError(f"VAPTSettings.shots={shots} exceeds the {len(pool)} training images of class {c} "
                             f"of {task.name!r}")
        idx.append(pool[torch.randperm(len(pool), generator=g)[:shots]])
    idx_t = torch.cat(idx)
    n = len(task.y_test) if max_test is None else min(max_test, len(task.y_test))
    return task.x_train[idx_t], task.y_train[idx_t], task.x_test[:n], task.y_test[:n]


def _batches(n: int, S: VAPTSettings, seed: int) -> list[torch.Tensor]:
    """Index batches of every epoch (one seeded shuffle per epoch), the same for every row."""
    g = torch.Generator().manual_seed(10_000 + seed)
    out = []
    for _ in range(S.epochs):
        perm = torch.randperm(n, generator=g)
        out += [perm[i:i + S.batch_size] for i in range(0, n, S.batch_size)]
    return out


def _fit(forward: Any, params: list[nn.Parameter], modules: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
         batches: list[torch.Tensor], S: VAPTSettings, seed: int) -> dict[str, Any]:
    # The dropouts (VPT's prompt dropout, VAPT's Dropout2d, PEFT LoRA's) draw from torch's global generator:
    # seed it for every row, so that a row's numbers depend on the seed alone, not on what ran before it in the
    # process (a model built on first use, another reproduction of the same report).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _fit_seeded(forward, params, modules, x, y, batches, S)


def _fit_seeded(forward: Any, params: list[nn.Parameter], modules: list[nn.Module], x: torch.Tensor,
                y: torch.Tensor, batches: list[torch.Tensor], S: VAPTSettings) -> dict[str, Any]:
    opt = torch.optim.AdamW(params, lr=S.lr, weight_decay=S.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / len(batches))))
    for m in modules:
        m.train()
    losses, times = [], []
    for b in batches:
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(forward(x[b]), y[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    for m in modules:
        m.eval()
    return {"losses": losses, "step_s": statistics.median(times)}


@torch.no_grad()
def _correct(logits: torch.Tensor, y: torch.Tensor) -> list[float]:
    return (logits.argmax(-1) == y).double().tolist()


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=x).logits


def _wiring(base: nn.Module, S: VAPTSettings, x: torch.Tensor) -> dict[str, float]:
    """The identities of checks (e), (f), (g), (i) on fresh copies of the backbone."""
    cfg = _vapt_config(S, "vapt")
    m = vapt.apply_vapt(copy.deepcopy(base), cfg).eval()
    seen: list[torch.Tensor] = []
    hooks = [layer.base_layer.register_forward_pre_hook(lambda mod, a: seen.append(a[0]))
             for _, layer in vapt.vapt_layers(m)]
    _logits(m, x)
    for h in hooks:
        h.remove()
    grid = vapt.find_backbone(m).grid
    n_p, n = S.num_prompts, grid[0] * grid[1]
    generated = seen[S.vpt_depth:]  # the inputs of the layers whose prompts are generated
    zero = max((float(t[:, 1:1 + n_p].abs().max()) for t in generated), default=0.0)
    bad_len = sum(int(t.shape[1] != 1 + n_p + n) for t in seen)
    L = len(seen)
    deep = vapt.apply_vapt(copy.deepcopy(base), _vapt_config(S, "vpt-deep")).eval()
    all_static = vapt.apply_vapt(copy.deepcopy(base), dataclasses.replace(cfg, vpt_depth=L)).eval()
    return {"zero_init": zero, "bad_lengths": float(bad_len),
            "formula_diff": float(vapt.count_parameters(m) - vapt.expected_parameters(m, cfg)),
            "depth_L_diff": float((_logits(deep, x) - _logits(all_static, x)).abs().max())}


def _vapt_config(S: VAPTSettings, method: str, seed: int = 0) -> vapt.VAPTConfig:
    return vapt.VAPTConfig(num_prompts=S.num_prompts, method=method, vpt_depth=S.vpt_depth, kernel_size=S.kernel_size,
                           mlp_hidden=S.mlp_hidden, seed=seed)


def _run_task(name: str, S: VAPTSettings, seed: int) -> dict[str, Any]:
    import peft

    from rankwise import zoo

    task = zoo.digits_task(name, seed=seed, image_size=16)
    x, y, xt, yt = _few_shot(task, S.shots, S.max_test, seed)
    base = zoo.pretrained_vit(S.backbone, num_labels=task.num_labels, seed=seed)
    for p in base.parameters():
        p.requires_grad_(False)
    batches = _batches(len(y), S, seed)
    out: dict[str, Any] = {"n_test": len(yt), "chance": 1.0 / task.num_labels, "acc": {}, "correct": {},
                           "params": {}, "step_s": {}, "losses": {}}

    def record(key: str, logits: torch.Tensor, params: int, fit: dict[str, Any]) -> None:
        out["correct"][key] = _correct(logits, yt)
        out["acc"][key] = statistics.fmean(out["correct"][key])
        out["params"][key], out["step_s"][key], out["losses"][key] = params, fit["step_s"], fit["losses"]

    # linear probe on the frozen [CLS] features (identical to training the head on the frozen model)
    probe = copy.deepcopy(base).eval()
    with torch.no_grad():
        feats = probe.vit(pixel_values=x).last_hidden_state[:, 0]  # after the final LayerNorm, as the head reads it
        feats_t = probe.vit(pixel_values=xt).last_hidden_state[:, 0]
    head = probe.classifier
    for p in head.parameters():
        p.requires_grad_(True)
    fit = _fit(lambda xb: head(xb), list(head.parameters()), [head], feats, y, batches, S, seed)
    record("probe", head(feats_t).detach(), 0, fit)

    before = {k: v.clone() for k, v in base.vit.state_dict().items()}
    backbone_diff = 0.0
    for key, method in (("vpt", "vpt-deep"), ("vapt", "vapt")):
        m = vapt.apply_vapt(copy.deepcopy(base), _vapt_config(S, method, seed))
        params = vapt.trainable_parameters(m)
        fit = _fit(lambda xb, m=m: m(pixel_values=xb).logits, params, [m], x, y, batches, S, seed)
        record(key, _logits(m, xt), vapt.count_parameters(m), fit)
        after = {k: v for k, v in m.vit.state_dict().items() if ".prompts." not in k}
        after = {k.replace(".base_layer", ""): v for k, v in after.items()}
        backbone_diff = max(backbone_diff, max(float((before[k] - after[k]).abs().max()) for k in before))
        if set(before) != set(after):
            raise RuntimeError(f"VAPT changed the backbone's parameter names: {sorted(set(before) ^ set(after))[:4]}")
    out["backbone_diff"] = backbone_diff

    full = copy.deepcopy(base)
    for p in full.parameters():
        p.requires_grad_(True)
    fit = _fit(lambda xb: full(pixel_values=xb).logits, list(full.parameters()), [full], x, y, batches, S, seed)
    record("full", _logits(full, xt), sum(p.numel() for n, p in full.named_parameters()
                                          if not n.startswith("classifier.")), fit)

    cfg = peft.LoraConfig(r=S.lora_rank, lora_alpha=S.lora_alpha, lora_dropout=0.1,
                          target_modules=["query", "value"], modules_to_save=["classifier"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lora = peft.get_peft_model(copy.deepcopy(base), cfg)
    params = [p for p in lora.parameters() if p.requires_grad]
    fit = _fit(lambda xb: lora(pixel_values=xb).logits, params, [lora], x, y, batches, S, seed)
    record("lora", _logits(lora, xt), sum(p.numel() for n, p in lora.named_parameters()
                                          if p.requires_grad and "lora_" in n), fit)
    if name == S.tasks[0]:
        out["wiring"] = _wiring(base, S, xt[:8])
    return out


class VAPTReproduction(Reproduction[VAPTSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1

    def measure(self, settings: VAPTSettings, seed: int) -> dict[str, Any]:
        return {"tasks": {name: _run_task(name, settings, seed) for name in settings.tasks}}

    def table(self, settings: VAPTSettings, records: Records[dict]) -> Table:
        cols = [f"acc {t}" for t in settings.tasks] + ["mean accuracy", "added parameters", "step (ms)"]
        t = Table(columns=cols, notes={"mean accuracy": "mean over the tasks of the test accuracy",
                                       "added parameters": "trained parameters besides the head",
                                       "step (ms)": "median training step (forward + backward + AdamW), under load"})
        for r in records:
            for row, key in zip(ROWS, KEYS):
                accs = [r["tasks"][name]["acc"][key] for name in settings.tasks]
                for name, a in zip(settings.tasks, accs):
                    t.add(row, f"acc {name}", a)
                t.add(row, "mean accuracy", statistics.fmean(accs))
                t.add(row, "added parameters", r["tasks"][settings.tasks[0]]["params"][key])
                t.add(row, "step (ms)", 1e3 * statistics.fmean(r["tasks"][n]["step_s"][key] for n in settings.tasks))
        self._t = t
        return t

    def _paired(self, settings: VAPTSettings, records: Records[dict], a: str, b: str) -> list[list[float]]:
        """Per seed: per test image, correct_a - correct_b, weighted so that the mean is the mean over tasks."""
        out = []
        for r in records:
            total = sum(r["tasks"][n]["n_test"] for n in settings.tasks)
            k = len(settings.tasks)
            seed = []
            for n in settings.tasks:
                w = total / (k * r["tasks"][n]["n_test"])
                ca, cb = r["tasks"][n]["correct"][a], r["tasks"][n]["correct"][b]
                seed += [w * (u - v) for u, v in zip(ca, cb)]
            out.append(seed)
        return out

    def preconditions(self, settings: VAPTSettings, records: Records[dict]) -> list[Precondition]:
        t = self._t
        chance = statistics.fmean(records.first["tasks"][n]["chance"] for n in settings.tasks)
        best = max(t.mean(row, "mean accuracy") for row in ROWS)
        return [Precondition("the linear probe learned: its mean accuracy - chance", t.mean("linear probe",
                             "mean accuracy") - chance, ">", MIN_ABOVE_CHANCE),
                Precondition("the tasks do not saturate: the best row's mean accuracy", best, "<", MAX_SATURATION)]

    def checks(self, settings: VAPTSettings, records: Records[dict]) -> list[ClaimCheck]:
        t = self._t

        def diff(a: str, b: str) -> float:
            return t.mean(a, "mean accuracy") - t.mean(b, "mean accuracy")

        p_vapt, p_vpt = t.mean("VAPT", "added parameters"), t.mean("VPT-deep", "added parameters")
        wiring = [r["tasks"][settings.tasks[0]]["wiring"] for r in records]
        return [
            ClaimCheck("(a) VAPT beats VPT-deep: mean accuracy VAPT - VPT-deep", diff("VAPT", "VPT-deep"), ">=",
                       MARGIN_VPT, samples=self._paired(settings, records, "vapt", "vpt")),
            ClaimCheck("(b) VAPT adds fewer parameters than VPT-deep: ratio", p_vapt / p_vpt, "<", 1.0, unit="x"),
            ClaimCheck("(c) VAPT beats the linear probe: mean accuracy VAPT - probe", diff("VAPT", "linear probe"),
                       ">", 0.0, samples=self._paired(settings, records, "vapt", "probe")),
            ClaimCheck("(d) VPT-deep beats the linear probe: mean accuracy VPT-deep - probe",
                       diff("VPT-deep", "linear probe"), ">", 0.0,
                       samples=self._paired(settings, records, "vpt", "probe")),
            ClaimCheck("(e) generated prompts at initialisation: max |P|", max(w["zero_init"] for w in wiring), "<=",
                       TOL_ZERO, kind="wiring"),
            ClaimCheck("(f) layers whose input is not 1 + N_p + N tokens", sum(w["bad_lengths"] for w in wiring), "<=",
                       0.0, kind="wiring"),
            ClaimCheck("(g) |added parameters - the spec's formula|", max(abs(w["formula_diff"]) for w in wiring), "<=",
                       0.0, kind="wiring"),
            ClaimCheck("(h) backbone after training: max |change|", max(r["tasks"][n]["backbone_diff"] for r in records
                                                                         for n in settings.tasks), "<=", 0.0,
                       kind="wiring"),
            ClaimCheck("(i) vpt_depth = L vs VPT-deep: max |logit difference|", max(w["depth_L_diff"] for w in wiring),
                       "<=", 0.0, kind="wiring"),
        ]

    def figures(self, settings: VAPTSettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        t = self._t
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        ax = axes[0]
        width = 0.8 / len(ROWS)
        for i, row in enumerate(ROWS):
            vals = [t.mean(row, f"acc {n}") for n in settings.tasks]
            ax.bar([j + i * width for j in range(len(settings.tasks))], vals, width, label=row)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(settings.tasks))], list(settings.tasks))
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"test accuracy (mean over {len(records)} seed{'s' * (len(records) > 1)})")
        ax.legend(fontsize=7)
        ax = axes[1]
        for row in ROWS[1:]:
            ax.scatter(max(1.0, t.mean(row, "added parameters")), t.mean(row, "mean accuracy"), label=row)
        ax.axhline(t.mean("linear probe", "mean accuracy"), color="k", ls=":", lw=1, label="linear probe")
        ax.set_xscale("log")
        ax.set_xlabel("added trainable parameters (head excluded)")
        ax.set_ylabel("mean accuracy over the tasks")
        ax.legend(fontsize=7)
        return [save_figure(fig, out_dir / "vapt.png")]

    def config(self, settings: VAPTSettings, records: Records[dict]) -> dict[str, Any]:
        from rankwise import zoo

        info = zoo.tiny_vit_info(settings.backbone, build=False) or {}
        return {"backbone": "zoo.pretrained_vit(%r)" % settings.backbone,
                "backbone_source_accuracy": info.get("metrics", {}).get("source_test_accuracy"),
                "n_test": {n: records.first["tasks"][n]["n_test"] for n in settings.tasks},
                "optimizer": "AdamW, cosine decay to 0, every row", "threads": torch.get_num_threads()}

    def extra(self, settings: VAPTSettings, records: Records[dict]) -> dict[str, Any]:
        return {"losses": {str(s): {n: r["tasks"][n]["losses"] for n in settings.tasks} for s, r in records.items()}}

    def notes(self, settings: VAPTSettings, records: Records[dict]) -> str:
        t = self._t
        return (f"Frozen tiny ViT pretrained on digits 0-4; {settings.shots} shots per class; {settings.epochs} epochs "
                f"of batch {settings.batch_size} at lr {settings.lr:g} for every row (no per-row tuning). "
                f"VAPT - VPT-deep = "
                f"{100 * (t.mean('VAPT', 'mean accuracy') - t.mean('VPT-deep', 'mean accuracy')):+.1f} "
                f"points; VAPT - full fine-tuning = "
                f"{100 * (t.mean('VAPT', 'mean accuracy') - t.mean('full fine-tuning', 'mean accuracy')):+.1f} points "
                "(the paper's win over full fine-tuning is not expected at this scale and is not checked).")


REPRODUCTION = VAPTReproduction
run = VAPTReproduction.run
