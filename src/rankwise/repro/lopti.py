"""Reproduction of Lopti / Advantage Reweighting (arXiv 2505.12929): low-probability tokens dominate GRPO's
gradient, and attenuating them (AR, Lopti, both) trains a better policy than plain GRPO.

World (:class:`rankwise.zoo.synthetic.AdditionWorld`, character vocabulary): ``"37+45="`` -> ``"82<eos>"``;
reward 1.0 for the exact answer, else 0.

* Warm-up policy: the cached ``zoo.warm_lm("lopti")`` (tiny Llama, 2 layers, hidden 128, 4 heads, FFN 256),
  1500 AdamW steps of 32 on noisy labels (30 % of the answers off by one in a digit), completion-only
  loss, stopped while greedy exact match is partial (the spec's 40-60 %), so GRPO groups have reward
  variance. Problems: the 7600 training / 500 held-out split of ``zoo.warm.addition_split``.
* Rows, every one from the same warm-up copy with the same rollout budget (``steps`` x 16 prompts x G = 8,
  temperature 1, 4 new tokens, AdamW lr 2e-5 constant (the spec's 5e-4 collapses plain GRPO here; the rate
  was chosen for the baseline, see the docs), beta 0.001 k3 KL, eps 0.2, token-mean "bnpo" loss, clipping 1):
  GRPO through TRL's ``GRPOTrainer`` (the library baseline), and this package's loop as GRPO, GRPO+AR
  (alpha 0.3), GRPO+Lopti (eta 0.5, low first) and GRPO+AR+Lopti. The own-loop rows see the same prompt
  sequence (drawn from the seed); TRL's row gets the same prompts as its dataset.
* Evaluation: greedy exact match on the 500 held-out problems.

Checks (thresholds are the spec's, stated before any run):

(1) mechanistic: on the warm-up policy's rollouts (``n_probe`` prompts x G), the mean per-token norm of the
    gradient of ``A log pi`` (``|A| = 1``) with respect to the final hidden state, lowest-probability
    quartile / highest quartile >= 3.
(2) outcome: exact match GRPO+AR+Lopti >= GRPO + 3 points (against this package's GRPO and, where it ran,
    TRL's), and (where they ran) AR alone and Lopti alone >= GRPO - 1 point; paired per-problem
    differences (bootstrap over problems, and seeds when >= 3).
Wiring: AR with alpha = 0 gives the plain GRPO loss bit for bit; the autograd hidden-state gradient norms
equal the closed form ``||W^T (e_o - pi)||``; this package's bnpo loss equals TRL's ``_compute_loss`` on the
same rollout (beta > 0: the reference model rebuilt by TRL from the saved policy directory).
Preconditions: the warm-up policy's rollouts have reward variance (a share of groups with nonzero reward
std), its greedy exact match is partial, plain GRPO learned (it beats the warm-up policy), no row saturates.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting
from rankwise.train.lopti import (
    AdvantageReweighting,
    GRPOConfig,
    GRPOTrainer,
    Lopti,
    aggregate,
    completion_logps,
    grpo_trainer,
    hidden_grad_norms,
    per_token_loss,
    quartile_means,
    trl_loss,
    trl_parity_inputs,
)
from rankwise.train.sft import exact_match, generate

ID = "lopti"
CLAIM = ("Low-probability tokens dominate GRPO's gradient (lowest-probability quartile >= 3x the highest in hidden-"
         "state gradient norm), and GRPO with Advantage Reweighting and Lopti reaches >= 3 points higher exact "
         "match than plain GRPO at the same rollout budget, each alone no worse than GRPO - 1 point.")

ARMS = ("trl_grpo", "grpo", "ar", "lopti", "ar_lopti")
ROW = {"trl_grpo": "GRPO (TRL GRPOTrainer)", "grpo": "GRPO (ours)", "ar": "GRPO+AR", "lopti": "GRPO+Lopti",
       "ar_lopti": "GRPO+AR+Lopti"}
WARM_ROW = "warm-up policy (no RL)"
QROWS = ("Q1 (lowest p)", "Q2", "Q3", "Q4 (highest p)")

MIN_QUARTILE_RATIO = 3.0   # claim 1
MARGIN_BOTH = 0.03         # claim 2: AR+Lopti - GRPO
MARGIN_ALONE = -0.01       # claim 2: AR (Lopti) alone - GRPO
MIN_VAR_GROUPS = 0.25      # precondition: share of warm-up groups with nonzero reward std
WARM_EM_RANGE = (0.10, 0.90)  # precondition: the warm-up policy is partial
MIN_GRPO_GAIN = 0.0        # precondition: GRPO (ours) beats the warm-up policy
MAX_EM = 0.98              # precondition: no saturation
TOL_CLOSED_FORM = 1e-4     # wiring: relative to the largest norm
TOL_TRL = 1e-5             # wiring: relative to the mean |per-token loss|


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoptiSettings(Settings):
    """What the Lopti reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    warm: str = setting("lopti", "warm-up policy (zoo.warm recipe)", choices=("lopti", "lopti-smoke"))
    arms: tuple[str, ...] = setting(ARMS, "trained rows, from trl_grpo, grpo, ar, lopti, ar_lopti")
    steps: int = setting(150, "GRPO steps (rollout batches) per row, the same budget for every row", lo=1)
    prompts_per_step: int = setting(16, "prompts per rollout batch", lo=1)
    num_generations: int = setting(8, "completions per prompt (G)", lo=2)
    lr: float = setting(2e-5, "AdamW learning rate (constant, every row; the spec's 5e-4 collapses plain GRPO "
                        "here, see the docs)", lo=0.0)
    beta: float = setting(0.001, "k3 KL coefficient", lo=0.0)
    epsilon: float = setting(0.2, "clip range (low and high)", lo=0.0)
    temperature: float = setting(1.0, "rollout temperature", lo=0.0)
    max_new_tokens: int = setting(4, "new tokens per completion", lo=1)
    alpha: float = setting(0.3, "AR alpha", lo=0.0, hi=1.0)
    eta: float = setting(0.5, "Lopti threshold on pi_old", lo=0.0, hi=1.0)
    n_probe: int = setting(64, "prompts of the warm-up rollouts for claim 1 (x G completions)", lo=4)
    n_test: int = setting(500, "held-out problems for exact match", lo=1, hi=500)

    def validate(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms or "grpo" not in self.arms:
            raise ValueError(f"LoptiSettings.arms must be a subset of {list(ARMS)} that contains 'grpo', "
                             f"got {self.arms}")


SETTINGS: dict[str, LoptiSettings] = {
    "smoke": LoptiSettings(warm="lopti-smoke", arms=("trl_grpo", "grpo", "ar_lopti"), steps=2, prompts_per_step=4,
                           num_generations=4, n_probe=8, n_test=16),
    # the spec's quick mode: claim 1, and 40 steps of GRPO and GRPO+AR+Lopti on one seed (plus TRL's GRPO)
    "quick": LoptiSettings(arms=("trl_grpo", "grpo", "ar_lopti"), steps=40, n_probe=32, seeds=(0,)),
    # full: all five rows (TRL's GRPO, ours, AR, Lopti, AR+Lopti), 3 seeds, 100 steps each: 150 steps were
    # sized at ~13 CPU min (0.34 CPU s per row-step), over the 10-minute budget; 100 steps ~9 min
    "full": LoptiSettings(steps=100, seeds=(0, 1, 2)),
}


def _reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """TRL-signature exact-match reward: 1.0 when the completion (spaces stripped) is the answer."""
    return [1.0 if c.replace(" ", "") == a else 0.0 for c, a in zip(completions, answer)]


def _config(s: LoptiSettings, seed: int) -> GRPOConfig:
    return GRPOConfig(num_generations=s.num_generations, epsilon=s.epsilon, beta=s.beta, loss_type="bnpo",
                      temperature=s.temperature, max_completion_length=s.max_new_tokens, seed=seed)


def _hooks(arm: str, s: LoptiSettings) -> list[Any]:
    return {"grpo": [], "ar": [AdvantageReweighting(s.alpha)], "lopti": [Lopti(s.eta)],
            "ar_lopti": [AdvantageReweighting(s.alpha), Lopti(s.eta)]}[arm]


def _em(model: Any, tok: Any, test: list[Any], s: LoptiSettings) -> list[float]:
    outs = generate(model, tok, [e.prompt for e in test], max_new_tokens=s.max_new_tokens, batch_size=500)
    return exact_match([o.replace(" ", "") for o in outs], [e.meta["answer"] for e in test])


def _own_arm(base: Any, tok: Any, schedule: list[list[Any]], arm: str, s: LoptiSettings, seed: int) -> dict[str, Any]:
    model = copy.deepcopy(base).train()
    tr = GRPOTrainer(model, tok, _reward, _config(s, seed), ref_model=base,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0),
                     token_hooks=_hooks(arm, s))
    t0 = time.perf_counter()
    for batch in schedule:
        tr.step([e.prompt for e in batch], answer=[e.meta["answer"] for e in batch])
    wall = time.perf_counter() - t0
    h = tr.history
    return {"model": model.eval(), "rewards": [m["reward"] for m in h], "step_s": wall / len(schedule),
            "update_s": statistics.fmean(m.get("update_s", 0.0) for m in h),
            "low_share": statistics.fmean(m["low_share"] for m in h) if "low_share" in h[0] else None}


def _trl_arm(base: Any, tok: Any, schedule: list[list[Any]], s: LoptiSettings, seed: int,
             probe_rollout: Any = None) -> dict[str, Any]:
    rows = [{"prompt": e.prompt, "answer": e.meta["answer"]} for batch in schedule for e in batch]
    t0 = time.perf_counter()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="rankwise-lopti-") as tmp:
        warnings.simplefilter("ignore")
        trainer = grpo_trainer(copy.deepcopy(base), tok, rows, _reward, _config(s, seed),
                               prompts_per_step=s.prompts_per_step, steps=s.steps, lr=s.lr,
                               policy_dir=Path(tmp) / "policy", output_dir=str(Path(tmp) / "out"))
        # wiring, before any step: our loss vs TRL's _compute_loss on the warm-up rollout (the same trainer)
        trl_diff = None if probe_rollout is None or s.beta == 0 else _trl_diff(trainer, probe_rollout,
                                                                                 _config(s, seed), s)
        trainer.train()
    wall = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"model": trainer.model.eval(), "rewards": rewards, "step_s": wall / s.steps, "update_s": None,
            "low_share": None, "trl_diff": trl_diff}


def _probe(base: Any, tok: Any, prompts: list[Any], s: LoptiSettings) -> dict[str, Any]:
    """Claim 1 on the warm-up policy's rollouts, and the wiring identities on the same rollout."""
    cfg = _config(s, 12345)
    tr = GRPOTrainer(base, tok, _reward, cfg, ref_model=base)
    r = tr.rollout([e.prompt for e in prompts], answer=[e.meta["answer"] for e in prompts])
    g = hidden_grad_norms(base, r, s.temperature)
    G = s.num_generations
    rec: dict[str, Any] = {
        "n_tokens": r.n_tokens, "reward": float(r.rewards.mean()),
        "var_groups": float((r.rewards.view(-1, G).std(1) > 0).float().mean()),
        "quartile_norm": quartile_means(g["grad_norm"], g["p_old"]),
        "quartile_p": quartile_means(g["p_old"], g["p_old"]),
        "scatter": list(zip(g["p_old"], g["grad_norm"]))[:2000],
        "closed_form_err": max(abs(a - b) for a, b in zip(g["grad_norm"], g["closed_form"]))
        / max(max(g["closed_form"]), 1e-12),
    }
    # wiring: AR with alpha = 0 is plain GRPO, bit for bit
    ar0 = GRPOTrainer(base, tok, _reward, cfg, ref_model=base, token_hooks=[AdvantageReweighting(0.0)])
    with torch.no_grad():
        a, _ = tr.loss(r, tr.token_advantages(r), r.completion_mask)
        b, _ = ar0.loss(r, ar0.token_advantages(r), r.completion_mask)
    rec["ar0_diff"] = abs(float(a) - float(b))
    rec["rollout"] = r  # for the TRL parity check (dropped before the record is stored)
    return rec


def _trl_parity(base: Any, tok: Any, r: Any, cfg: GRPOConfig, s: LoptiSettings) -> float:
    """|ours - TRL| of the bnpo loss on rollout ``r`` (AR advantages, perturbed logp_old, beta > 0), relative to
    the mean |per-token loss| (see :func:`_trl_diff`)."""
    cfg = dataclasses.replace(cfg, beta=max(cfg.beta, 1e-3))
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="rankwise-lopti-") as tmp:
        warnings.simplefilter("ignore")
        trainer = grpo_trainer(copy.deepcopy(base), tok, [{"prompt": "10+10=", "answer": "20"}] * 2, _reward, cfg,
                               prompts_per_step=1, steps=1, lr=s.lr, policy_dir=Path(tmp) / "policy",
                               output_dir=str(Path(tmp) / "out"))
        return _trl_diff(trainer, r, cfg, s)


def _trl_diff(trainer: Any, r: Any, cfg: GRPOConfig, s: LoptiSettings) -> float:
    r = copy.copy(r)
    r.logp_old = r.logp_old + 0.2 * torch.randn(r.logp_old.shape, generator=torch.Generator().manual_seed(0))
    adv = AdvantageReweighting(s.alpha).reweight(r.advantages, r.logp_old)
    with torch.no_grad():
        r.logp_ref = completion_logps(trainer.ref_model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                      r.completion_mask, s.temperature)
        theirs = float(trl_loss(trainer, trl_parity_inputs(r, adv)))
        logp = completion_logps(trainer.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                s.temperature)
        per, _ = per_token_loss(logp, r.logp_old, adv, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.clip_high,
                                beta=cfg.beta, logp_ref=r.logp_ref)
        ours = float(aggregate(per, r.completion_mask, "bnpo"))
        # the scale of the summands: group-normalised advantages make the loss a sum of terms of both signs
        # that nearly cancel (on one full-mode seed the loss was 2e-4 of the mean |term|), so |ours - theirs|
        # / |loss| magnified float32 rounding to 2e-5; against the terms' scale the same difference is 4e-9
        scale = float(aggregate(per.abs(), r.completion_mask, "bnpo"))
    trainer._metrics["train"].clear()  # the check's forward must not show in the first logged training metrics
    return abs(ours - theirs) / max(scale, 1e-12)


class LoptiReproduction(Reproduction[LoptiSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1

    def _warm(self, s: LoptiSettings) -> tuple[Any, Any, list[int], list[int]]:
        if getattr(self, "_cache", None) is None:
            from rankwise.zoo import warm

            model, tok = warm.warm_lm(s.warm)
            train, test = warm.addition_split()
            self._cache = (model, tok, train, test)
        return self._cache

    def measure(self, s: LoptiSettings, seed: int) -> dict[str, Any]:
        from rankwise.zoo.synthetic import AdditionWorld

        base, tok, train_idx, test_idx = self._warm(s)
        world = AdditionWorld()
        gen = torch.Generator().manual_seed(10_000 + seed)
        pick = torch.randint(0, len(train_idx), (s.steps * s.prompts_per_step + s.n_probe,), generator=gen).tolist()
        problems = world.examples([train_idx[i] for i in pick])
        probe, rest = problems[:s.n_probe], problems[s.n_probe:]
        schedule = [rest[k * s.prompts_per_step:(k + 1) * s.prompts_per_step] for k in range(s.steps)]
        test = world.examples(test_idx[:s.n_test])
        rec: dict[str, Any] = {"probe": _probe(base, tok, probe, s), "warm": _em(base, tok, test, s), "arms": {}}
        rollout = rec["probe"].pop("rollout")
        for arm in s.arms:
            if arm == "trl_grpo":
                r = _trl_arm(base, tok, schedule, s, seed, rollout)
                rec["probe"]["trl_diff"] = r.pop("trl_diff")
            else:
                r = _own_arm(base, tok, schedule, arm, s, seed)
            rec["arms"][arm] = {"correct": _em(r.pop("model"), tok, test, s), **r}
        if "trl_diff" not in rec["probe"]:
            rec["probe"]["trl_diff"] = _trl_parity(base, tok, rollout, _config(s, 12345), s)
        return rec

    def table(self, s: LoptiSettings, records: Records[dict]) -> Table:
        t = Table(columns=["exact match", "train reward (last 10)", "step (ms)", "update (ms)", "low-token share",
                           "grad norm |A|=1", "mean p_old"], notes={
            "exact match": "greedy exact match on the held-out problems",
            "train reward (last 10)": "mean rollout reward over the last 10 steps",
            "step (ms)": "wall time per step (rollout + update), under whatever load the machine had",
            "update (ms)": "wall time of the update alone (own loop; Lopti runs two backward passes)",
            "low-token share": "share of completion tokens with pi_old < eta (Lopti rows)",
            "grad norm |A|=1": "warm-up rollouts: mean ||d log pi / d h|| per probability quartile (claim 1)",
            "mean p_old": "mean rollout probability of the quartile's tokens"})
        for r in records:
            t.add(WARM_ROW, "exact match", statistics.fmean(r["warm"]))
            for arm in ARMS:
                if arm not in r["arms"]:
                    continue
                a = r["arms"][arm]
                t.add(ROW[arm], "exact match", statistics.fmean(a["correct"]))
                if a["rewards"]:
                    t.add(ROW[arm], "train reward (last 10)", statistics.fmean(a["rewards"][-10:]))
                t.add(ROW[arm], "step (ms)", 1e3 * a["step_s"])
                if a["update_s"] is not None:
                    t.add(ROW[arm], "update (ms)", 1e3 * a["update_s"])
                if a["low_share"] is not None:
                    t.add(ROW[arm], "low-token share", a["low_share"])
            for q, row in enumerate(QROWS):
                t.add(row, "grad norm |A|=1", r["probe"]["quartile_norm"][q])
                t.add(row, "mean p_old", r["probe"]["quartile_p"][q])
        self._t = t
        return t

    def _em(self, arm: str) -> float:
        return self._t.mean(ROW[arm], "exact match")

    def preconditions(self, s: LoptiSettings, records: Records[dict]) -> list[Precondition]:
        warm_em = self._t.mean(WARM_ROW, "exact match")
        pre = [Precondition("the warm-up policy's rollouts have reward variance: share of groups with nonzero "
                            "reward std", statistics.fmean(r["probe"]["var_groups"] for r in records), ">=",
                            MIN_VAR_GROUPS),
               Precondition("the warm-up policy is partial: greedy exact match >= 0.10", warm_em, ">=",
                            WARM_EM_RANGE[0]),
               Precondition("the warm-up policy is partial: greedy exact match <= 0.90", warm_em, "<=",
                            WARM_EM_RANGE[1])]
        if len(s.arms) > 1:
            pre.append(Precondition("plain GRPO (ours) learned: exact match gain over the warm-up policy",
                                    self._em("grpo") - warm_em, ">", MIN_GRPO_GAIN))
            pre.append(Precondition("no row saturates: highest exact match",
                                    max(self._em(a) for a in s.arms), "<=", MAX_EM))
        return pre

    def checks(self, s: LoptiSettings, records: Records[dict]) -> list[ClaimCheck]:
        qn = [statistics.fmean(r["probe"]["quartile_norm"][q] for r in records) for q in range(4)]
        checks = [
            ClaimCheck("(1) mean hidden-state gradient norm (|A| = 1), lowest / highest probability quartile",
                       qn[0] / qn[3], ">=", MIN_QUARTILE_RATIO, unit="x"),
            ClaimCheck("AR with alpha = 0 vs plain GRPO: |loss difference| (bitwise)",
                       max(r["probe"]["ar0_diff"] for r in records), "<=", 0.0, kind="wiring"),
            ClaimCheck("autograd hidden-state gradient norms vs the closed form ||W^T (e_o - pi)||: max |difference| "
                       "/ largest norm", max(r["probe"]["closed_form_err"] for r in records), "<=", TOL_CLOSED_FORM,
                       kind="wiring"),
            ClaimCheck("bnpo loss, ours vs TRL GRPOTrainer._compute_loss (AR advantages, beta > 0): |difference| / "
                       "mean |per-token loss|", max(r["probe"]["trl_diff"] for r in records), "<=", TOL_TRL, kind="wiring"),
        ]

        def paired(a: str, b: str) -> list[list[float]]:
            return [[x - y for x, y in zip(r["arms"][a]["correct"], r["arms"][b]["correct"])] for r in records]

        def check(a: str, b: str, margin: float) -> ClaimCheck:
            d = paired(a, b)
            return ClaimCheck(f"(2) exact match {ROW[a]} - {ROW[b]}", statistics.fmean(statistics.fmean(x) for x in d),
                              ">=", margin, samples=d)

        if "ar_lopti" in s.arms:
            checks.append(check("ar_lopti", "grpo", MARGIN_BOTH))
            if "trl_grpo" in s.arms:
                checks.append(check("ar_lopti", "trl_grpo", MARGIN_BOTH))
        for alone in ("ar", "lopti"):
            if alone in s.arms:
                checks.append(check(alone, "grpo", MARGIN_ALONE))
        return checks

    def figures(self, s: LoptiSettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
        ax = axes[0]
        qn = [self._t.mean(r, "grad norm |A|=1") for r in QROWS]
        qp = [self._t.mean(r, "mean p_old") for r in QROWS]
        ax.bar(range(4), qn, color=["C3", "C1", "C2", "C0"])
        ax.set_xticks(range(4), [f"{r}\nmean p {p:.2f}" for r, p in zip(QROWS, qp)], fontsize=7)
        ax.set_ylabel(r"mean $\|\partial \log \pi(o_t) / \partial h_t\|$")
        ax.set_title(f"warm-up rollouts: gradient norm by probability quartile ({qn[0] / qn[3]:.1f}x)", fontsize=9)
        ax = axes[1]
        pts = records.first["probe"]["scatter"]
        ax.scatter([1 - p for p, _ in pts], [g for _, g in pts], s=3, alpha=0.4)
        ax.set_xlabel(r"$1 - \pi_{old}(o_t)$")
        ax.set_ylabel("gradient norm w.r.t. the final hidden state")
        ax.set_title("per token (seed %d)" % records.seeds[0], fontsize=9)
        ax = axes[2]
        rows = [WARM_ROW] + [ROW[a] for a in ARMS if a in s.arms]
        means = [self._t.mean(r, "exact match") for r in rows]
        ax.bar(range(len(rows)), means, color=["C7"] + ["C0"] * (len(rows) - 1))
        for i, r in enumerate(rows):
            vals = self._t.values(r, "exact match")
            ax.plot([i] * len(vals), vals, "k.", ms=4)
        ax.set_xticks(range(len(rows)), [r.replace(" (", "\n(") for r in rows], fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_ylabel("greedy exact match (held-out)")
        ax.set_title(f"{s.steps} steps x {s.prompts_per_step} prompts x G={s.num_generations}, "
                     f"{len(records.seeds)} seed(s)", fontsize=9)
        return [save_figure(fig, out_dir / "lopti.png")]

    def config(self, s: LoptiSettings, records: Records[dict]) -> dict[str, Any]:
        return {"probe_tokens": records.first["probe"]["n_tokens"], "threads": torch.get_num_threads(),
                "baseline": "trl.GRPOTrainer (beta > 0: reference rebuilt from the saved policy directory)"}

    def notes(self, s: LoptiSettings, records: Records[dict]) -> str:
        p = records.first["probe"]
        qn = [round(x, 3) for x in p["quartile_norm"]]
        return (f"Warm-up rollouts (seed {records.seeds[0]}): {p['n_tokens']} completion tokens, mean reward "
                f"{p['reward']:.3f}, {p['var_groups']:.2f} of the groups with reward variance; gradient norm by "
                f"quartile {qn}. The gradient of log pi(o) w.r.t. the final hidden state is W^T(e_o - pi), whose "
                "norm grows with 1 - pi(o), so claim 1 is close to a property of the softmax head; claim 2 is the "
                "empirical part. Every row has the same rollout budget; the own-loop rows see the same prompt "
                "sequence, TRL's row the same prompts in its own sampler's order, and each row's sampling noise "
                "differs once the policies differ. Quick mode runs the spec's quick rows (GRPO and "
                "GRPO+AR+Lopti, 40 steps, one seed) plus TRL's GRPO; AR and Lopti alone are full mode's.")


REPRODUCTION = LoptiReproduction
run = LoptiReproduction.run
