"""Reproduction of PAVE (spec ``shared/methods/pave.md``): identify the helpful learnware from a parameter-vector
spec of the user's few labelled examples, against learnware's own RKME specification.

Setting (all offline, on the embedded all-MiniLM-L6-v2):

* tasks: binary docstring tasks of :func:`rankwise.zoo.text_tasks`, taken by a fixed rule (the binary tasks
  in the zoo's order with >= 200 training and >= 80 test examples: dunder, private, raises, returns_bool,
  mentions_none, length, ...); quick uses the first 4, full the first 6;
* repository (built once per run, seed 0): per task a learnware whose PAVE spec is computed on the
  developer's ``n_dev`` training examples and labels (shared frozen A, B + head trained, rank 16 on
  query/key/value of the adapted layers) and whose RKME spec is learnware's ``RKMETableSpecification`` of the
  same texts' L2-normalised mean-pooled MiniLM embeddings. With ``dev_models`` the developer also trains the
  learnware model itself (LoRA r = 8 on query/value + head, its own seed), and ``n_corrupt`` extra learnwares
  are trained (model and spec) on a real task with ``corrupt_rate`` of the labels flipped;
* users (per seed): for each task, ``n_user`` labelled examples drawn from the task's held-out split; the rest
  of that split (up to ``n_user_test``) is the user's test set. PAVE ranks the repository by cosine, RKME by
  MMD^2. Identification is correct when the top-1 is the task's own learnware (or, with learnware models,
  one at least as accurate on the user's test set). Rows with models: the identified learnware's accuracy,
  random selection (mean over learnwares), oracle (best learnware), user fine-tune (LoRA r = 8 + head on
  ``ft_shots`` of the user's examples, the same budget as a developer).

The adapted layers are the top ``layers`` of the encoder: the frozen lower layers are run once per text
(:class:`~rankwise.repro.kit.cached_encoder.FrozenPrefix`), exactly, since theta_0 runs in eval mode.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.core.io import model_fingerprint
from rankwise.repro.kit.cached_encoder import (
    FrozenPrefix,
    TopModel,
    batch_indices,
    cached_batches,
    evaluate_cached,
    train_lockstep,
)
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting
from rankwise.science import pave as pv
from rankwise.science.pave import TopEncoder

ID = "pave"
CLAIM = ("PAVE specs (frozen shared A, B-only) identify the learnware of the user's task from a few labelled "
         "examples: top-1 accuracy >= the mode's threshold (80 % full, 3 of 4 quick) and >= RKME's + 15 points; "
         "with learnware models (full), reusing the identified learnware is within 2 points of, or better than, "
         "fine-tuning on the user's 16 examples.")

TOP1_GAIN = 0.15  # PAVE top-1 - RKME top-1 (spec)
REUSE_TOL = -0.02  # acc(identified) - acc(user fine-tune) (spec)
SPEC_LEARNED = 0.65  # precondition: mean final cross-entropy of the learnware spec fine-tunes (ln 2 = 0.693)
ORACLE_GAP = 0.05  # precondition: oracle - random accuracy (picking a learnware matters)
FT_ABOVE_CHANCE = 0.02  # precondition: user fine-tune accuracy - 0.5
WIRING_TOL = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class PaveSettings(Settings):
    """What the PAVE reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    tasks: tuple[str, ...] = setting(("dunder", "private", "raises", "returns_bool"),
                                     "binary zoo text tasks (one learnware and one user each)")
    n_dev: int = setting(200, "developer's training examples per learnware", lo=8)
    n_user: int = setting(24, "user's labelled examples (from the task's held-out split)", lo=2)
    n_user_test: int = setting(100, "user's test examples at most (the rest of the held-out split)", lo=2)
    max_length: int = setting(32, "tokens per text", lo=4)
    layers: tuple[int, ...] = setting((4, 5), "adapted (top) encoder layers; the layers below are cached")
    rank: int = setting(16, "rank of the shared spec adapter", lo=1)
    spec_steps: int = setting(30, "fine-tuning steps per spec (the same for every spec)", lo=1)
    batch_size: int = setting(16, "batch size of every fine-tune", lo=1)
    lr: float = setting(1e-3, "AdamW learning rate of every fine-tune", lo=0.0)
    l1_kind: str = setting("induced", "L1 norm of the spec penalty", choices=("induced", "elementwise"))
    rkme: bool = setting(True, "run learnware's RKME rows (skipped when learnware is absent)")
    rkme_k: int = setting(100, "RKME reduced-set size (learnware uses 2n/3 when n <= K)", lo=1)
    dev_models: bool = setting(False, "train the learnware models (accuracy rows, user fine-tune, reuse claim)")
    dev_steps: int = setting(60, "steps of a developer's (and the user's) LoRA r = 8 fine-tune", lo=1)
    ft_shots: int = setting(16, "user examples of the user fine-tune row", lo=2)
    n_corrupt: int = setting(0, "corrupted learnwares (trained with flipped labels; needs dev_models)", lo=0)
    corrupt_rate: float = setting(0.4, "fraction of flipped labels of a corrupted learnware", lo=0.0, hi=1.0)
    top1_min: float = setting(0.80, "the spec's top-1 threshold for this mode (full 0.80, quick 3 of 4)",
                              lo=0.0, hi=1.0)

    def validate(self) -> None:
        if len(self.tasks) < 2 or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"PaveSettings.tasks must hold >= 2 distinct tasks, got {self.tasks!r}")
        top = tuple(range(6 - len(self.layers), 6))
        if tuple(sorted(self.layers)) != top:
            raise ValueError(f"PaveSettings.layers must be the top layers of the 6-layer encoder, e.g. (4, 5), "
                             f"got {self.layers!r}")
        if self.n_corrupt and not self.dev_models:
            raise ValueError("PaveSettings.n_corrupt needs dev_models=true")
        if self.ft_shots > self.n_user:
            raise ValueError(f"PaveSettings.ft_shots must be <= n_user ({self.n_user}), got {self.ft_shots}")


SETTINGS = {
    "smoke": PaveSettings(tasks=("dunder", "private"), n_dev=24, n_user=8, n_user_test=16, max_length=16,
                          layers=(5,), rank=4, spec_steps=3, batch_size=8, rkme_k=8, dev_models=True, dev_steps=2,
                          ft_shots=8, n_corrupt=1, seeds=(0,)),
    "quick": PaveSettings(top1_min=0.75, seeds=(0,)),
    # full: 6 tasks + 2 corrupted learnwares, 3 seeds; 60 spec steps (100 were sized at ~4,200 steps, 13-14
    # CPU min for three seeds). With 60-step learnware and user models it measured 731 CPU s (0.235 s a step);
    # 30-step models make ~2,340 steps, about 550 CPU s. The spec steps stay at 60 (the learning precondition).
    "full": PaveSettings(tasks=("dunder", "private", "raises", "returns_bool", "mentions_none", "length"),
                         spec_steps=60, dev_models=True, n_corrupt=2, dev_steps=30),
}


class _Cache:
    """Frozen-prefix outputs per text, computed once per run."""

    def __init__(self, prefix: FrozenPrefix) -> None:
        self.prefix = prefix
        self.rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        todo = [t for t in dict.fromkeys(texts) if t not in self.rows]
        if todo:
            h, m = self.prefix.encode(todo)
            self.rows.update({t: (h[i], m[i]) for i, t in enumerate(todo)})
        return (torch.stack([self.rows[t][0] for t in texts]), torch.stack([self.rows[t][1] for t in texts]))


@torch.no_grad()
def _pooled(enc: TopEncoder, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    out = enc(h, m)
    w = m[..., None].to(out.dtype)
    return (out * w).sum(1) / w.sum(1).clamp_min(1.0)


class PaveReproduction(Reproduction[PaveSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1

    # -- the run's shared state ---------------------------------------------------------------
    def _setup(self, s: PaveSettings) -> None:
        if hasattr(self, "_repo"):
            return
        from rankwise import zoo

        bert, tok = zoo.minilm()
        self._cache = _Cache(FrozenPrefix(bert, tok, min(s.layers), s.max_length))
        self._enc = TopEncoder(bert, s.layers).eval()
        self._bert = bert
        self._fp = model_fingerprint(self._enc)
        self._cfg = pv.PaveConfig(rank=s.rank, layers=tuple(s.layers), steps=s.spec_steps, batch_size=s.batch_size,
                                  lr=s.lr, max_length=s.max_length, l1_kind=s.l1_kind)
        self._tasks = {name: zoo.text_task(name, seed=0) for name in s.tasks}
        self._rkme_on = s.rkme and _has_learnware()
        repo: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(s.tasks):
            repo[name] = {"task": name, "data": list(self._tasks[name].train[: s.n_dev]), "seed": 100 + i}
        for j in range(s.n_corrupt):
            name = s.tasks[j % len(s.tasks)]
            rng = random.Random(1000 + j)
            data = [(t, 1 - y if rng.random() < s.corrupt_rate else y) for t, y in self._tasks[name].train[: s.n_dev]]
            repo[f"{name} (corrupted {j})"] = {"task": name, "data": data, "seed": 200 + j}
        for lw in repo.values():
            texts = [t for t, _ in lw["data"]]
            h, m = self._cache.get(texts)
            labels = torch.tensor([y for _, y in lw["data"]])
            lw["spec"] = pv.spec_from_inputs(self._enc, {"hidden": h, "attention_mask": m}, labels, self._cfg,
                                             fingerprint=self._fp)
            if self._rkme_on:
                lw["rkme"] = pv.rkme_spec(_pooled(self._enc, h, m), k=s.rkme_k, seed=0)
            if s.dev_models:
                lw["model"] = self._train_lora(s, h, m, labels, lw["seed"])
        self._repo = repo

    def _train_lora(self, s: PaveSettings, h: torch.Tensor, m: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
        """A learnware model (or the user's): LoRA r = 8 (query, value) on the top layers + a seeded head."""
        from rankwise.core.lora import add_lora

        model = TopModel(self._bert, len(s.layers), 2, seed)
        add_lora(model, ("query", "value"), rank=8, alpha=16.0, generator=torch.Generator().manual_seed(seed))
        model.classifier.requires_grad_(True)
        idx = batch_indices(len(y), s.dev_steps, min(s.batch_size, len(y)), seed)
        train_lockstep({"m": model}, cached_batches(h, m, y, idx), seed, {"m": (s.lr, s.lr)})
        return model.eval()

    # -- one seed -----------------------------------------------------------------------------
    def measure(self, s: PaveSettings, seed: int) -> dict[str, Any]:
        self._setup(s)
        names = list(self._repo)
        specs = {n: lw["spec"] for n, lw in self._repo.items()}
        out: dict[str, Any] = {"learnwares": names, "trials": []}
        for name in s.tasks:
            test = list(self._tasks[name].test)
            order = list(range(len(test)))
            random.Random(seed).shuffle(order)
            user = [test[i] for i in order[: s.n_user]]
            utest = [test[i] for i in order[s.n_user: s.n_user + s.n_user_test]]
            h, m = self._cache.get([t for t, _ in user])
            y = torch.tensor([l for _, l in user])
            uspec = pv.spec_from_inputs(self._enc, {"hidden": h, "attention_mask": m}, y, self._cfg, fingerprint=self._fp)
            ident = pv.identify(uspec, specs)
            trial: dict[str, Any] = {"task": name, "pave_top": ident.best.name,
                                     "pave_cos": {mt.name: mt.cosine for mt in ident.matches},
                                     "user_norm": uspec.norm(), "user_ce": uspec.info["final_ce"]}
            if self._rkme_on:
                ur = pv.rkme_spec(_pooled(self._enc, h, m), k=s.rkme_k, seed=0)
                ranking = pv.rkme_identify(ur, {n: lw["rkme"] for n, lw in self._repo.items()})
                trial["rkme_top"] = ranking[0][0]
                trial["rkme_mmd"] = dict(ranking)
            if s.dev_models:
                th, tm = self._cache.get([t for t, _ in utest])
                ty = torch.tensor([l for _, l in utest])
                trial["acc"] = {n: evaluate_cached(lw["model"], th, tm, ty)[0] for n, lw in self._repo.items()}
                ft = self._train_lora(s, h[: s.ft_shots], m[: s.ft_shots], y[: s.ft_shots], 300 + seed)
                trial["ft_acc"] = evaluate_cached(ft, th, tm, ty)[0]
            for method in ("pave", "rkme"):
                if f"{method}_top" in trial:
                    trial[f"{method}_correct"] = float(self._correct(trial, trial[f"{method}_top"]))
            out["trials"].append(trial)
            if name == s.tasks[0]:
                out["wiring"] = self._wiring(s, uspec, h, m, y, specs, trial)
        out["base_unchanged"] = model_fingerprint(self._enc) == self._fp
        return out

    def _correct(self, trial: dict[str, Any], top: str) -> bool:
        if self._repo[top]["task"] == trial["task"] and "corrupted" not in top:
            return True
        acc = trial.get("acc")
        return acc is not None and acc[top] >= acc[trial["task"]]

    def _wiring(self, s: PaveSettings, uspec: pv.PaveSpec, h: torch.Tensor, m: torch.Tensor, y: torch.Tensor,
                specs: dict[str, pv.PaveSpec], trial: dict[str, Any]) -> dict[str, float]:
        """Identities only a bug can break, on the first user's data (a short spec for the backend check)."""
        short = dataclasses.replace(self._cfg, steps=3)
        a = pv.spec_from_inputs(self._enc, {"hidden": h, "attention_mask": m}, y, short, fingerprint=self._fp)
        b = pv.spec_from_inputs(self._enc, {"hidden": h, "attention_mask": m}, y,
                                dataclasses.replace(short, backend="peft"), fingerprint=self._fp)
        lw = specs[s.tasks[0]]
        trace_err, bw_gap = 0.0, []
        for mod in lw.modules():
            bu, bk = uspec.tensors[f"{mod}.lora_B"], lw.tensors[f"{mod}.lora_B"]
            A = pv.shared_a(mod, self._in_features(mod), s.rank, self._cfg.a_seed)
            t1, t2 = pv.trace_inner(bu, bk, A), pv.delta_inner(bu, bk, A)
            trace_err = max(trace_err, abs(t1 - t2) / max(abs(t2), 1e-30))
        mods = lw.modules()
        As = [pv.shared_a(md, self._in_features(md), s.rank, self._cfg.a_seed) for md in mods]
        bus = [uspec.tensors[f"{md}.lora_B"] for md in mods]
        bks = [lw.tensors[f"{md}.lora_B"] for md in mods]
        bcos = float(torch.nn.functional.cosine_similarity(torch.cat([b.reshape(-1) for b in bus]).double(),
                                                           torch.cat([b.reshape(-1) for b in bks]).double(), dim=0))
        bw_gap.append(abs(bcos - pv.delta_cosine(bus, bks, As)))
        w = {"backend_max_abs": float((a.vector() - b.vector()).abs().max()),
             "trace_rel_err": trace_err,
             "self_cos_err": abs(pv.cosine(uspec, uspec) - 1.0),
             "symmetry_err": abs(pv.cosine(uspec, lw) - pv.cosine(lw, uspec)),
             "b_vs_delta_cos_gap": bw_gap[0]}
        if self._rkme_on:
            ur = pv.rkme_spec(_pooled(self._enc, h, m), k=s.rkme_k, seed=0)
            lr = self._repo[s.tasks[0]]["rkme"]
            ours, theirs = pv.rkme_mmd(ur, lr), ur.learnware.dist(lr.learnware)
            w["rkme_mmd_rel_err"] = abs(ours - theirs) / max(abs(theirs), 1e-30)
            w["rkme_self_mmd"] = abs(pv.rkme_mmd(ur, ur))
        return w

    def _in_features(self, module: str) -> int:
        return int(self._enc.get_submodule(module).in_features)

    # -- results ------------------------------------------------------------------------------
    def table(self, s: PaveSettings, records: Records[dict]) -> Table:
        t = Table(columns=["top-1 identification", "user test accuracy"],
                  notes={"top-1 identification": "fraction of user tasks whose top-1 learnware is the right one",
                         "user test accuracy": "accuracy on the user's test split of the model the row reuses "
                                               "(or trains)"})
        for r in records:
            tr = r["trials"]
            t.add("PAVE", "top-1 identification", _mean(x["pave_correct"] for x in tr))
            if "rkme_correct" in tr[0]:
                t.add("RKME (learnware)", "top-1 identification", _mean(x["rkme_correct"] for x in tr))
            t.add("random selection", "top-1 identification", sum(
                1.0 for x in tr for n in r["learnwares"] if self._correct(x, n)) / (len(tr) * len(r["learnwares"])))
            if "acc" in tr[0]:
                t.add("PAVE", "user test accuracy", _mean(x["acc"][x["pave_top"]] for x in tr))
                if "rkme_top" in tr[0]:
                    t.add("RKME (learnware)", "user test accuracy", _mean(x["acc"][x["rkme_top"]] for x in tr))
                t.add("random selection", "user test accuracy", _mean(_mean(x["acc"].values()) for x in tr))
                t.add("oracle (best learnware)", "user test accuracy", _mean(max(x["acc"].values()) for x in tr))
                t.add(f"user fine-tune ({s.ft_shots} shots)", "user test accuracy", _mean(x["ft_acc"] for x in tr))
        self._t = t
        return t

    def preconditions(self, s: PaveSettings, records: Records[dict]) -> list[Precondition]:
        ce = _mean(lw["spec"].info["final_ce"] for lw in self._repo.values())
        out = [Precondition("the learnware spec fine-tunes learned their task: mean final cross-entropy",
                            ce, "<=", SPEC_LEARNED)]
        if s.dev_models:
            out.append(Precondition("picking a learnware matters: oracle - random user test accuracy",
                                    self._t.mean("oracle (best learnware)", "user test accuracy")
                                    - self._t.mean("random selection", "user test accuracy"), ">=", ORACLE_GAP))
            out.append(Precondition("the user fine-tune learned: its accuracy - 0.5",
                                    self._t.mean(f"user fine-tune ({s.ft_shots} shots)", "user test accuracy") - 0.5,
                                    ">=", FT_ABOVE_CHANCE))
        return out

    def checks(self, s: PaveSettings, records: Records[dict]) -> list[ClaimCheck]:
        pave = [[x["pave_correct"] for x in r["trials"]] for r in records]
        checks = [ClaimCheck(f"PAVE top-1 identification accuracy over {len(pave[0])} user tasks x {len(pave)} seed(s)",
                             _mean(_mean(p) for p in pave), ">=", s.top1_min, samples=pave)]
        if "rkme_correct" in records.first["trials"][0]:
            diff = [[x["pave_correct"] - x["rkme_correct"] for x in r["trials"]] for r in records]
            checks.append(ClaimCheck("PAVE top-1 - RKME top-1 (paired per user task)", _mean(_mean(d) for d in diff),
                                     ">=", TOP1_GAIN, samples=diff))
        if s.dev_models:
            diff = [[x["acc"][x["pave_top"]] - x["ft_acc"] for x in r["trials"]] for r in records]
            checks.append(ClaimCheck(f"accuracy of the PAVE-identified learnware - user fine-tune ({s.ft_shots} shots)",
                                     _mean(_mean(d) for d in diff), ">=", REUSE_TOL, samples=diff))
        w = [r["wiring"] for r in records]
        checks += [
            ClaimCheck("computing specs leaves the base model unchanged (fingerprint mismatches)",
                       float(sum(not r["base_unchanged"] for r in records)), "<=", 0.0, kind="wiring"),
            ClaimCheck("rankwise LoRA and PEFT backends give the same spec (max |diff|, 3 steps)",
                       max(x["backend_max_abs"] for x in w), "<=", WIRING_TOL, kind="wiring"),
            ClaimCheck("trace(B_u A A^T B_k^T) = <B_u A, B_k A>_F (max relative error)",
                       max(x["trace_rel_err"] for x in w), "<=", 1e-9, kind="wiring"),
            ClaimCheck("cos(tau, tau) = 1 and cos is symmetric (max error)",
                       max(max(x["self_cos_err"], x["symmetry_err"]) for x in w), "<=", 1e-12, kind="wiring"),
        ]
        if "rkme_mmd_rel_err" in w[0]:
            checks.append(ClaimCheck("our MMD^2 equals learnware's RKME dist (relative error)",
                                     max(x["rkme_mmd_rel_err"] for x in w), "<=", WIRING_TOL, kind="wiring"))
            checks.append(ClaimCheck("RKME MMD^2(P, P) = 0", max(x["rkme_self_mmd"] for x in w), "<=", 1e-9,
                                     kind="wiring"))
        return checks

    def figures(self, s: PaveSettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        r = records.first
        lws, users = r["learnwares"], [x["task"] for x in r["trials"]]
        panels = [("PAVE cosine", [[x["pave_cos"][n] for n in lws] for x in r["trials"]])]
        if "rkme_mmd" in r["trials"][0]:
            panels.append(("RKME -MMD^2", [[-x["rkme_mmd"][n] for n in lws] for x in r["trials"]]))
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 0.5 * len(users) + 2.5), squeeze=False)
        for ax, (title, mat) in zip(axes[0], panels):
            im = ax.imshow(mat, aspect="auto", cmap="viridis")
            ax.set_xticks(range(len(lws)), lws, rotation=45, ha="right", fontsize=7)
            ax.set_yticks(range(len(users)), users, fontsize=7)
            ax.set_xlabel("learnware")
            ax.set_ylabel("user task")
            ax.set_title(f"{title} (seed {records.seeds[0]})")
            for i, row in enumerate(mat):
                j = max(range(len(row)), key=row.__getitem__)
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=1.5))
            fig.colorbar(im, ax=ax)
        fig.tight_layout()
        names = [save_figure(fig, out_dir / "pave_similarity.png")]
        if s.dev_models:
            rows = [row for row in self._t.rows if self._t.values(row, "user test accuracy")]
            fig, ax = plt.subplots(figsize=(6, 3.2))
            means = [self._t.mean(row, "user test accuracy") for row in rows]
            ax.barh(rows, means, color="tab:blue")
            ax.set_xlim(0.4, 1.0)
            ax.set_xlabel("user test accuracy (mean over user tasks and seeds)")
            fig.tight_layout()
            names.append(save_figure(fig, out_dir / "pave_reuse.png"))
        return names

    def notes(self, s: PaveSettings, records: Records[dict]) -> str:
        lw0 = next(iter(self._repo.values()))["spec"]
        txt = (f"{len(s.tasks)} user tasks x {len(records)} seed(s); repository of {len(self._repo)} learnwares "
               f"(built once, seed 0). Spec: rank {s.rank} on query/key/value of layers {list(s.layers)}, "
               f"{lw0.num_parameters():,} numbers per spec, {s.spec_steps} steps, L1 {s.l1_kind}; A drawn per module "
               "from a_seed and the module name, so a layer's A does not depend on which layers are adapted. "
               f"Cosine of B-vectors vs cosine of the full Delta W (first user/learnware pair): gap "
               f"{records.first['wiring']['b_vs_delta_cos_gap']:.4f}.")
        if s.rkme and not self._rkme_on:
            txt += " learnware is not installed: the RKME rows and checks are skipped."
        if not s.dev_models:
            txt += (" This mode trains no learnware models, so the reuse claim and the accuracy rows are left to "
                    "full mode (as in the spec).")
        return txt


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def _has_learnware() -> bool:
    import importlib.util

    return importlib.util.find_spec("learnware") is not None and importlib.util.find_spec("fast_pytorch_kmeans") is not None


REPRODUCTION = PaveReproduction
run = PaveReproduction.run
