"""Reproduction of RACS / Alice (ICLR 2026): tiny Llama pretraining on the stdlib docstring corpus.

Setting (spec "Reproduction at small scale"): ``LlamaConfig`` hidden 64, FFN 172, 2 layers, 4 heads,
byte vocabulary 256 (ids = UTF-8 bytes), random init under the seed; the zoo's docstring corpus
(train split for training, eval split, held-out modules, for validation); sequence length 128,
batch 16, cosine learning rate with 5 % warm-up, no gradient clipping. RACS, Alice and GaLore act on
every 2-D block weight; embeddings, LM head and norms use AdamW at AdamW's learning rate. Alice:
r = 16, l = 4, T = 50; GaLore (galore-torch): r = 16, T = 50, scale 0.25.

* smoke: a 1-layer hidden-32 model, 10 steps, AdamW / RACS / Alice (wiring only; the peers'
  imports alone take seconds, their wiring is covered by tests/train/test_racs_alice.py).
* quick (<= 60 s): 150 steps of 64-byte sequences, AdamW, RACS, Alice and GaLore at their default learning rates
  (AdamW 3e-3, RACS 0.1, Alice 0.02, GaLore 1e-2), every optimizer on three seeds (issue 14: RACS
  and GaLore ran on the first seed only, so claim (ii) was one seed's difference inside the seed
  spread; with three seeds the intervals resample the seeds).
* full (<= 10 min): 500 steps (the spec's 800 do not fit the sweeps). Every optimizer (AdamW,
  Adafactor, GaLore, RACS, Alice) gets the same 3-point learning-rate sweep (default x {1/3, 1, 3};
  AdamW {1e-3, 3e-3, 1e-2}) on the first seed at a quarter of the horizon (125 steps, same schedule
  shape); the best rate then runs the full horizon: AdamW and Alice on every seed, Adafactor, GaLore
  and RACS on the first two. pytorch-optimizer's RACS / Alice run at the rates tuned for ours (first
  seed).

Measured: validation loss every ``eval_every`` steps; steps for Alice to reach AdamW's final loss
(linear interpolation between evaluations); optimizer-state bytes (all state tensors, and those of
the 2-D block weights alone); time per step.

The sizes, model and optimizers are :class:`RacsAliceSettings` (``SETTINGS[mode]``; ``rankwise reproduce
racs_alice --set steps=300 optimizers=adamw,alice``). "RACS keeps exactly m + n + 1 floats per matrix"
is a ``wiring`` check (an invariant of the implementation); the others are ``claim`` checks. The two
final-loss checks carry the paired per-validation-window loss differences of the final models
(:func:`rankwise.repro.kit.windows.window_losses`), the speed-up check one value per seed, so their
bootstrap intervals are reported. Preconditions (stated before any run): AdamW and GaLore, the
baselines the claims compare against, end below the unigram floor (the cross-entropy of the validation
bytes under the training split's byte frequencies, :func:`unigram_floor`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting

logger = logging.getLogger(__name__)

ID = "racs_alice"
CLAIM = ("Alice reaches Adam(W)'s final loss in less than half the steps and ends lower, while RACS matches "
         "GaLore-class quality with SGD-like optimizer memory (m + n + 1 floats per matrix); optimizer memory "
         "orders RACS < GaLore <= Alice < AdamW.")

NAMES = {"adamw": "AdamW", "adafactor": "Adafactor", "galore": "GaLore", "racs": "RACS", "alice": "Alice",
         "racs_port": "RACS (pytorch-optimizer)", "alice_port": "Alice (pytorch-optimizer)"}
DEFAULT_LR = {"adamw": 3e-3, "adafactor": 1e-2, "galore": 1e-2, "racs": 0.1, "alice": 0.02}
GRIDS = {"adamw": (1e-3, 3e-3, 1e-2), "adafactor": (1e-2 / 3, 1e-2, 3e-2), "galore": (1e-2 / 3, 1e-2, 3e-2),
         "racs": (0.1 / 3, 0.1, 0.3), "alice": (0.02 / 3, 0.02, 0.06)}
EVERY_SEED = ("adamw", "alice")  # claim (i) is a mean over seeds
SPEEDUP_FRACTION = 0.7   # (i) Alice reaches AdamW's final loss within 0.7 T (the spec's, looser than the paper's 0.5)
ALICE_MARGIN = -0.02     # (i) Alice's final loss - AdamW's <= -0.02 nats
RACS_SLACK = 0.05        # (ii) RACS's final loss - GaLore's <= 0.05 nats
COLUMNS = ["final_val_loss", "steps_to_adamw_final", "state_bytes", "matrix_state_bytes", "ms_per_step", "lr"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RacsAliceSettings(Settings):
    """What the RACS / Alice reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    steps: int = setting(150, "training steps (horizon T of every run)", lo=1)
    seq_len: int = setting(128, "tokens (bytes) per sequence", lo=2)
    batch_size: int = setting(16, "sequences per step", lo=1)
    eval_windows: int = setting(32, "validation windows", lo=1)
    eval_every: int = setting(25, "steps between validation evaluations", lo=1)
    hidden_size: int = setting(64, "tiny Llama hidden size", lo=1)
    intermediate_size: int = setting(172, "tiny Llama FFN size", lo=1)
    num_hidden_layers: int = setting(2, "tiny Llama layers", lo=1)
    num_attention_heads: int = setting(4, "attention heads", lo=1)
    num_key_value_heads: int = setting(4, "key/value heads", lo=1)
    rank: int = setting(16, "rank r of Alice and GaLore", lo=1)
    leading_basis: int = setting(4, "Alice's leading basis l", lo=1)
    update_interval: int = setting(50, "projection update interval T of Alice and GaLore", lo=1)
    optimizers: tuple[str, ...] = setting(("adamw", "racs", "alice", "galore"), "optimizers run (adamw, adafactor, "
                                          "galore, racs, alice, racs_port, alice_port)")
    n_seeds_others: int = setting(1, "seeds of the optimizers other than AdamW and Alice (ports: the first)", lo=1)
    sweep_steps: int | None = setting(None, "steps of the 3-point learning-rate sweep on the first seed (None: "
                                            "default rates)", lo=1)

    def validate(self) -> None:
        for n in self.optimizers:
            if n not in NAMES:
                raise ValueError(f"RacsAliceSettings.optimizers must hold names of {', '.join(NAMES)}, got {n!r}")
        for n in ("adamw", "alice", "racs"):
            if n not in self.optimizers:
                raise ValueError(f"RacsAliceSettings.optimizers must include {n!r} (the claims use it)")

    @property
    def model(self) -> dict[str, Any]:
        return dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                    num_key_value_heads=self.num_key_value_heads, vocab_size=256, max_position_embeddings=256)


SETTINGS: dict[str, RacsAliceSettings] = {
    "smoke": RacsAliceSettings(steps=10, seq_len=32, batch_size=4, eval_windows=4, eval_every=5, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                               rank=8, leading_basis=2, update_interval=5, optimizers=("adamw", "racs", "alice")),
    # quick (issue 14): every optimizer on three seeds (RACS and GaLore used to run on the first only, so RACS -
    # GaLore was one seed's difference, inside the seed spread), so that the intervals of the paired comparisons
    # resample the seeds as well as the validation windows
    # To fit the 60 s budget (three seeds of 128-byte sequences took 130 s on an idle 2-core machine) the sequences
    # are 64 bytes: half the tokens per step, the same 150 steps, batch, schedule and rates.
    "quick": RacsAliceSettings(seq_len=64, n_seeds_others=3, seeds=(0, 1, 2)),
    "full": RacsAliceSettings(steps=500, eval_windows=64, eval_every=50,
                              optimizers=("adamw", "adafactor", "galore", "racs", "alice", "racs_port", "alice_port"),
                              n_seeds_others=2, sweep_steps=125),
}
_Setup = RacsAliceSettings


def _hp(name: str, s: _Setup) -> dict[str, Any]:
    if name in ("alice", "alice_port"):
        return dict(rank=s.rank, leading_basis=s.leading_basis, update_interval=s.update_interval)
    if name == "galore":
        return dict(rank=s.rank, update_interval=s.update_interval, scale=0.25)
    return {}


def _matrix_floats(model: torch.nn.Module) -> int:
    """sum over the 2-D block weights of (m + n + 1): RACS's state size in floats."""
    from rankwise.train.racs import split_params_for_lowmem

    return sum(p.shape[0] + p.numel() // p.shape[0] + 1 for p in split_params_for_lowmem(model)["matrix"])


def _run_one(name: str, lr: float, other_lr: float, seed: int, steps: int, s: _Setup, data: dict[str, torch.Tensor]) -> dict[str, Any]:
    from rankwise import zoo
    from rankwise.repro.kit.windows import window_losses
    from rankwise.train.pretrain import make_optimizer, matrix_state_bytes, pretrain
    from rankwise.train.racs import split_params_for_lowmem

    model = zoo.tiny_llama(seed, **s.model)
    opt = make_optimizer(name, model, lr, other_lr=other_lr, **_hp(name, s))
    t0 = time.perf_counter()
    res = pretrain(model, opt, data["train"], data["eval"], steps, seq_len=s.seq_len, batch_size=s.batch_size,
                   seed=seed, eval_every=min(s.eval_every, steps))
    mats = split_params_for_lowmem(model)["matrix"]
    out = {"name": name, "lr": lr, "seed": seed, "steps": res.eval_steps, "losses": res.eval_losses,
           "final": res.final_loss, "diverged": res.diverged, "state_bytes": res.state_bytes,
           "matrix_state_bytes": matrix_state_bytes(opt, mats), "ms_per_step": 1e3 * res.seconds_per_step,
           "matrix_floats": _matrix_floats(model), "wall_s": time.perf_counter() - t0,
           # the final model's loss on each validation window (the paired samples of the final-loss checks)
           "final_windows": None if res.diverged else window_losses(model, data["eval"]).tolist()}
    logger.info("%s lr=%.3g seed=%d: final %.4f (%.1f s)", name, lr, seed, out["final"], out["wall_s"])
    return out


def _mean_curve_reach(alice: list[dict[str, Any]], adamw: list[dict[str, Any]]) -> float | None:
    from rankwise.train.pretrain import steps_to_reach

    a = [r for r in alice if not r["diverged"]]
    b = [r for r in adamw if not r["diverged"]]
    if not a or not b or len({tuple(r["steps"]) for r in a + b}) != 1:
        return None
    steps = a[0]["steps"]
    mean = [sum(r["losses"][i] for r in a) / len(a) for i in range(len(steps))]
    target = sum(r["final"] for r in b) / len(b)
    return steps_to_reach(steps, mean, target)


def _plots(out_dir: Path, runs: dict[str, list[dict[str, Any]]], table: Table, steps: int) -> list[str]:
    plt = pyplot()

    figs = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, rs in runs.items():
        finite = [r for r in rs if not r["diverged"]]
        if not finite:
            continue
        xs = finite[0]["steps"]
        ys = [sum(r["losses"][i] for r in finite) / len(finite) for i in range(len(xs))]
        ax.plot(xs[1:], ys[1:], marker="o", ms=3, label=NAMES[name], ls="--" if name.endswith("_port") else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title(f"tiny Llama, {steps} steps (mean over seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    figs.append(save_figure(fig, out_dir / "loss_curves.png"))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    names = [n for n in runs if table.values(NAMES[n], "state_bytes")]
    vals = [table.mean(NAMES[n], "state_bytes") / 1024 for n in names]
    mvals = [table.mean(NAMES[n], "matrix_state_bytes") / 1024 for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], vals, width=0.4, label="all state")
    ax.bar([x + 0.2 for x in xs], mvals, width=0.4, label="2-D block weights only")
    ax.set_xticks(list(xs), [NAMES[n].replace(" (pytorch-optimizer)", "\n(port)") for n in names], fontsize=8)
    ax.set_ylabel("optimizer state (KiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    figs.append(save_figure(fig, out_dir / "state_bytes.png"))
    return figs


def _sweep(s: RacsAliceSettings, seed: int, data: dict[str, torch.Tensor]
           ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Learning rates: the defaults, or the 3-point sweep on ``seed`` at ``sweep_steps`` steps."""
    use_seeds = [seed]
    # learning rates: defaults, or the 3-point sweep (first seed, quarter horizon)
    lrs = {n: DEFAULT_LR[n.replace("_port", "")] for n in s.optimizers}
    sweep: dict[str, dict[str, float]] = {}
    if s.sweep_steps is not None:
        order = ["adamw"] + [n for n in s.optimizers if n in GRIDS and n != "adamw"]
        for name in order:
            other = lrs["adamw"]
            res = {lr: _run_one(name, lr, other, use_seeds[0], s.sweep_steps, s, data)["final"] for lr in GRIDS[name]}
            sweep[name] = {f"{lr:.4g}": v for lr, v in res.items()}
            finite = {lr: v for lr, v in res.items() if math.isfinite(v)}
            lrs[name] = min(finite, key=finite.get) if finite else DEFAULT_LR[name]
        for port in ("racs_port", "alice_port"):
            if port in lrs:
                lrs[port] = lrs[port.replace("_port", "")]

    return lrs, sweep


def _table(runs: dict[str, list[dict[str, Any]]]) -> Table:
    from rankwise.train.pretrain import steps_to_reach

    table = Table(columns=COLUMNS, notes={
        "final_val_loss": "nats per byte on the eval split, lower is better",
        "steps_to_adamw_final": "steps to reach AdamW's final validation loss (same seed); inf = never",
        "state_bytes": "all optimizer state tensors (bytes)",
        "matrix_state_bytes": "state of the 2-D block weights only (bytes)",
        "ms_per_step": "forward + backward + step, ms (contended machine: compare within a run)",
        "lr": "peak learning rate used"})
    adamw_final = {r["seed"]: r["final"] for r in runs["adamw"]}
    for name, rs in runs.items():
        for r in rs:
            row = NAMES[name]
            table.add(row, "final_val_loss", r["final"])
            target = adamw_final.get(r["seed"], float("nan"))
            reach = steps_to_reach(r["steps"], r["losses"], target) if not r["diverged"] else float("inf")
            table.add(row, "steps_to_adamw_final", reach)
            table.add(row, "state_bytes", r["state_bytes"])
            table.add(row, "matrix_state_bytes", r["matrix_state_bytes"])
            table.add(row, "ms_per_step", r["ms_per_step"])
            table.add(row, "lr", r["lr"])

    return table


def _paired(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> list[list[float]] | None:
    """Per seed that both ran, the per-validation-window loss of ``a`` minus ``b`` (None if one diverged)."""
    by_seed = {r["seed"]: r for r in runs[b]}
    pairs = [(r, by_seed[r["seed"]]) for r in runs[a] if r["seed"] in by_seed]
    if not pairs or any(x["final_windows"] is None or y["final_windows"] is None for x, y in pairs):
        return None
    return [[u - v for u, v in zip(x["final_windows"], y["final_windows"])] for x, y in pairs]


def _gap(runs: dict[str, list[dict[str, Any]]], table: Table, a: str, b: str
         ) -> tuple[float, list[list[float]] | None]:
    """Final-loss difference ``a - b``: the mean of the paired per-window differences (seeds both ran), or the
    difference of the table means when a run diverged."""
    paired = _paired(runs, a, b)
    if paired is None:
        return table.mean(NAMES[a], "final_val_loss") - table.mean(NAMES[b], "final_val_loss"), None
    return sum(sum(p) / len(p) for p in paired) / len(paired), paired


def _checks(s: RacsAliceSettings, runs: dict[str, list[dict[str, Any]]], table: Table) -> list[ClaimCheck]:
    T = s.steps
    checks = []
    alice_frac = [table.values("Alice", "steps_to_adamw_final")[i] / T for i in range(len(runs["alice"]))]
    # one value per seed; with >= 3 seeds the interval resamples them (never reaching AdamW's loss: no interval)
    frac_samples = [[f] for f in alice_frac] if all(math.isfinite(f) for f in alice_frac) else None
    checks.append(ClaimCheck("(i) Alice reaches AdamW's final validation loss within 0.7 x T steps (fraction of T, "
                             "mean over seeds; paper: < 0.5)", sum(alice_frac) / len(alice_frac), "<=",
                             SPEEDUP_FRACTION, samples=frac_samples))
    gap, paired = _gap(runs, table, "alice", "adamw")
    checks.append(ClaimCheck("(i) Alice's final validation loss is at least 0.02 nats below AdamW's (mean over seeds "
                             "of the paired per-window differences)", gap, "<=", ALICE_MARGIN, unit="nats",
                             samples=paired))
    if "galore" in runs:
        gap, paired = _gap(runs, table, "racs", "galore")
        checks.append(ClaimCheck("(ii) RACS's final validation loss is within 0.05 nats of GaLore's (mean over the "
                                 "seeds both ran of the paired per-window differences)", gap, "<=", RACS_SLACK,
                                 unit="nats", samples=paired))
    racs = runs["racs"][0]
    checks.append(ClaimCheck("RACS keeps exactly m + n + 1 floats per matrix (|state bytes - 4 sum(m+n+1)|)",
                             abs(racs["matrix_state_bytes"] - 4 * racs["matrix_floats"]), "<=", 0, unit="bytes",
                             kind="wiring"))
    if "galore" in runs:
        b = {n: table.mean(NAMES[n], "state_bytes") for n in ("racs", "galore", "alice", "adamw")}
        checks.append(ClaimCheck("optimizer state: RACS < GaLore", b["galore"] - b["racs"], ">", 0, unit="bytes"))
        checks.append(ClaimCheck("optimizer state: GaLore <= Alice", b["alice"] - b["galore"], ">=", 0, unit="bytes"))
        checks.append(ClaimCheck("optimizer state: Alice < AdamW", b["adamw"] - b["alice"], ">", 0, unit="bytes"))

    return checks


def _notes(s: RacsAliceSettings, mode: str, use_seeds: list[int], runs: dict[str, list[dict[str, Any]]],
           table: Table, checks: list[ClaimCheck], lrs: dict[str, float], sweep: dict[str, Any]) -> str:
    T = s.steps
    notes = [
        f"{mode} mode: {T} steps; AdamW and Alice ran seeds {use_seeds}, the other optimizers the first "
        f"{min(s.n_seeds_others, len(use_seeds))} (ports: the first); learning rates {', '.join(f'{NAMES[n]} {lr:.3g}' for n, lr in lrs.items())}.",
        "Byte-level tokens, so losses are nats per byte. RACS/Alice/GaLore act on the 2-D block weights; embeddings, "
        "LM head and norms use AdamW at AdamW's learning rate in every run, so the state-byte totals share that part "
        "and differ only by the block-weight state.",
        "The paper's claims are for LLaMA 60M-1B on C4; at this scale the speed-up is expected only qualitatively "
        "(spec), and RACS is not claimed to beat AdamW (its point is memory).",
    ]
    if s.sweep_steps is not None:
        notes.append(f"Every optimizer had the same 3-point learning-rate sweep on seed {use_seeds[0]} at "
                     f"{s.sweep_steps} steps (a quarter of the horizon, same schedule shape): {sweep}. Full mode runs "
                     f"{T} steps instead of the spec's 800 so that five equal sweeps and the seeds fit the 10-minute "
                     "budget; the thresholds are the spec's fractions of T.")
    else:
        notes.append("No learning-rate sweep in this mode: each optimizer runs at the spec's default rate.")
    if "racs_port" in runs:
        diffs = {NAMES[n]: table.mean(NAMES[n], "final_val_loss") - table.mean(NAMES[n.replace('_port', '')], "final_val_loss")
                 for n in ("racs_port", "alice_port") if runs.get(n)}
        notes.append(f"pytorch-optimizer's ports at our tuned rates (first seed): final-loss difference port - ours "
                     f"{ {k: round(v, 4) for k, v in diffs.items()} }. They differ by design: the RACS port uses row/"
                     "column means (no fixed point); the Alice port starts its basis from the zero matrix, samples the "
                     "complement at random and keeps Q in old coordinates (see docs/methods/racs_alice.md).")
    mean_reach = _mean_curve_reach(runs["alice"], runs["adamw"])
    if mean_reach is not None:
        notes.append(f"On the seed-averaged curves (same eval steps), Alice reaches AdamW's mean final loss at step "
                     f"{mean_reach:.0f} ({mean_reach / T:.2f} T); the check above pairs the seeds instead (a seed "
                     "on which Alice never reaches that seed's AdamW loss counts as never).")
    failed = [c for c in checks if not c.holds]
    if failed:
        notes.append("Claims that did not hold here: " + "; ".join(c.statement for c in failed) + ".")
        if any(c.statement.startswith("RACS's final") for c in failed):
            notes.append("RACS has no momentum and only a rank-1 diagonal preconditioner; at ~0.1M block parameters "
                         "it trails the Adam-type optimizers (the spec's own one-seed check found RACS behind AdamW "
                         "at this scale); the paper shows its advantage at 1B parameters.")
        if any(c.statement.startswith("Alice") for c in failed):
            notes.append("The spec expects Alice's speed-up only qualitatively at this scale (a few hundred steps of "
                         "a 0.1M-parameter model); the measurement is reported as is.")
    return " ".join(notes)


def unigram_floor(data: dict[str, torch.Tensor]) -> float:
    """Cross-entropy (nats per byte) of the validation bytes under the training split's byte frequencies
    (add-one smoothed): what a model that ignores context reaches; a trained model must go below it."""
    counts = torch.bincount(data["train"], minlength=256).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[data["eval"][:, 1:].reshape(-1)].mean())


def _preconditions(runs: dict[str, list[dict[str, Any]]], table: Table, floor: float) -> list[Precondition]:
    """The baselines the claims compare against learned: AdamW (claim (i)) and GaLore (claim (ii)) end below
    the context-free byte-frequency loss."""
    return [Precondition(f"{NAMES[n]} (a compared baseline) learned beyond byte frequencies: its mean final "
                         "validation loss - the unigram cross-entropy of the validation bytes",
                         table.mean(NAMES[n], "final_val_loss") - floor, "<", 0.0, unit="nats")
            for n in ("adamw", "galore") if runs.get(n)]


class RacsAliceReproduction(Reproduction[RacsAliceSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS

    def measure(self, s: RacsAliceSettings, seed: int) -> dict[str, list[dict[str, Any]]]:
        from rankwise import zoo
        from rankwise.train.pretrain import byte_stream, eval_windows

        if not hasattr(self, "data"):
            self.corpus = zoo.corpus()
            self.data = {"train": byte_stream(d.text for d in self.corpus.split("train")),
                         "eval": eval_windows(byte_stream(d.text for d in self.corpus.split("eval")), s.seq_len,
                                              s.eval_windows)}
            self.lrs, self.sweep = _sweep(s, seed, self.data)
            self.i = 0
        i, lrs = self.i, self.lrs
        self.i += 1
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in s.optimizers}
        for name in s.optimizers:
            if name not in EVERY_SEED and i >= (1 if name.endswith("_port") else s.n_seeds_others):
                continue
            runs[name].append(_run_one(name, lrs[name], lrs["adamw"], seed, s.steps, s, self.data))
        return runs

    def _runs(self, records: Records[dict]) -> dict[str, list[dict[str, Any]]]:
        return {n: [r for rec in records for r in rec[n]] for n in records.first}

    def table(self, s: RacsAliceSettings, records: Records[dict]) -> Table:
        self._table = _table(self._runs(records))
        return self._table

    def preconditions(self, s: RacsAliceSettings, records: Records[dict]) -> list[Precondition]:
        return _preconditions(self._runs(records), self._table, unigram_floor(self.data))

    def checks(self, s: RacsAliceSettings, records: Records[dict]) -> list[ClaimCheck]:
        self._checks = _checks(s, self._runs(records), self._table)
        return self._checks

    def figures(self, s: RacsAliceSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return _plots(out_dir, self._runs(records), self._table, s.steps)

    def notes(self, s: RacsAliceSettings, records: Records[dict]) -> str:
        mode = next((m for m, v in SETTINGS.items() if v == s), "custom")
        return _notes(s, mode, records.seeds, self._runs(records), self._table, self._checks, self.lrs, self.sweep)

    def config(self, s: RacsAliceSettings, records: Records[dict]) -> dict[str, Any]:
        return {"steps": s.steps, "seq_len": s.seq_len, "batch_size": s.batch_size, "eval_windows": s.eval_windows,
                "eval_every": s.eval_every, "model": s.model, "alice": {"rank": s.rank, "leading_basis": s.leading_basis,
                "update_interval": s.update_interval}, "galore": {"rank": s.rank, "update_interval": s.update_interval,
                "scale": 0.25}, "lrs": self.lrs, "sweep_steps": s.sweep_steps, "optimizers": list(s.optimizers),
                "corpus_sha256": self.corpus.info.get("sha256")}

    def extra(self, s: RacsAliceSettings, records: Records[dict]) -> dict[str, Any]:
        return {"curves": {n: [{"seed": r["seed"], "lr": r["lr"], "steps": r["steps"], "losses": r["losses"]}
                               for r in rs] for n, rs in self._runs(records).items()}, "sweep": self.sweep}


REPRODUCTION = RacsAliceReproduction
run = RacsAliceReproduction.run
