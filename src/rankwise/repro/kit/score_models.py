"""PriorGuide's trained score models, built once by a fixed recipe and cached (``rankwise zoo build``).

For each task (``gaussian_linear``, ``two_moons``, ``sir``) and seed: ``N`` pairs simulated under the
training prior (``Uniform[-3, 3]^2``; two moons ``Uniform[-1, 1]^2``; SIR ``(beta, gamma)`` in
``[1, 4] x [0.5, 2]`` per week, 10 weekly noisy infected fractions), then

* our :class:`~rankwise.science.priorguide.ScoreDiffusion` (MLP 4 x 64, ``sigma`` in [0.01, 5]),
  denoising score matching, Adam with cosine decay (``ours_*`` of :data:`RECIPE`);
* sbi's NPSE (VE SDE, MLP score network) on the same pairs (``sbi_*``), when sbi is installed;
* "retrained on q" (the spec's gold standard): our model with the same recipe trained on pairs simulated
  under each test prior q (``new_prior(task, kind)``, restricted to the training box).

Files: ``cache_dir()/priorguide/<task>-s<seed>-<hash>-{ours,sbi,q-gaussian,q-mixture}.safetensors``; the hash covers the
recipe and the torch/sbi major.minor versions. sbi estimators are stored as a state dict
(safetensors) and rebuilt around the regenerated training pairs (z-scoring buffers included), so
nothing is unpickled. Cold build (measured, one thread, idle-equivalent CPU): see docs/methods/priorguide.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import torch
from torch import Tensor

from rankwise.core import io
from rankwise.core.errors import ArtifactError
from rankwise.science import priorguide as pg
from rankwise.zoo import cache_dir
from rankwise.zoo.models import BUILD_THREADS, build_threads

__all__ = ["Q_KINDS", "RECIPE", "TASKS", "build", "new_prior", "q_score_model", "q_task_data", "sbi_estimator",
           "score_model", "task_data", "train_prior"]

logger = logging.getLogger(__name__)

TASKS = ("gaussian_linear", "two_moons", "sir")
RECIPE: dict[str, Any] = {
    "n_sims": 20_000, "noise": 0.1,
    "ours_hidden": 64, "ours_layers": 4, "ours_steps": 3000, "ours_batch": 128, "ours_lr": 1e-3,
    "sigma_min": 0.01, "sigma_max": 5.0,
    "sbi_hidden": 64, "sbi_layers": 3, "sbi_epochs": 30, "sbi_batch": 200,
    "version": 1,
}
#: What ``rankwise zoo build`` builds: every task for these seeds.
BUILD_SEEDS = (0, 1, 2)
#: The test priors of the reproduction (``new_prior(task, kind)``); Gaussian-linear's off-centre Gaussian.
Q_KINDS = ("gaussian", "mixture")
Q_MEAN = (1.0, -1.0)
Q_STD = 0.3


def train_prior(task: str) -> pg.BoxUniform:
    if task == "gaussian_linear":
        return pg.BoxUniform(-3 * torch.ones(2), 3 * torch.ones(2))
    if task == "two_moons":
        return pg.BoxUniform(-torch.ones(2), torch.ones(2))
    if task == "sir":
        return pg.BoxUniform(torch.tensor([1.0, 0.5]), torch.tensor([4.0, 2.0]))
    raise ValueError(f"task={task!r} is not a PriorGuide task; choose from {list(TASKS)}")


def new_prior(task: str, kind: str = "gaussian", scale: float | None = None) -> pg.GaussianMixture:
    """The new prior q of ``task``: ``kind="gaussian"`` an off-centre Gaussian (Gaussian-linear: N((1, -1),
    0.3^2 I), or ``scale^2 I`` for the sweep; two moons: N((0.3, -0.3), 0.2^2 I); SIR: N((2, 1), diag(0.25^2,
    0.12^2))), ``kind="mixture"`` an equal-weight 2-component mixture of it and its mirror image
    (Gaussian-linear: (-1, 1); two moons: (-0.3, 0.3); SIR: (3, 1.5))."""
    if task == "gaussian_linear":
        means, cov = [Q_MEAN, (-1.0, 1.0)], (scale or Q_STD) ** 2 * torch.eye(2)
    elif task == "two_moons":
        means, cov = [(0.3, -0.3), (-0.3, 0.3)], 0.04 * torch.eye(2)
    elif task == "sir":
        means, cov = [(2.0, 1.0), (3.0, 1.5)], torch.diag(torch.tensor([0.25**2, 0.12**2]))
    else:
        raise ValueError(f"task={task!r} is not a PriorGuide task")
    if kind == "gaussian":
        return pg.GaussianMixture([1.0], means[:1], [cov])
    if kind != "mixture":
        raise ValueError(f"kind={kind!r}: choose from {list(Q_KINDS)}")
    return pg.GaussianMixture([0.5, 0.5], means, [cov, cov])


def simulate(task: str, theta: Tensor, gen: torch.Generator, noise: float = 0.1) -> Tensor:
    """One draw of ``task``'s simulator per row of ``theta`` [N, 2] (``noise``: Gaussian-linear only;
    SIR uses its own observation noise, ``pg.tasks.SIR_NOISE``)."""
    if task == "gaussian_linear":
        return pg.gaussian_linear(theta, noise, gen)
    if task == "sir":
        return pg.sir(theta, gen)
    return pg.two_moons(theta, gen)


def task_data(task: str, seed: int, n: int, noise: float = 0.1) -> tuple[Tensor, Tensor]:
    """The training pairs ``(theta, x)`` (float32) of ``task`` for ``seed`` (deterministic)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    theta = train_prior(task).sample(n, gen)
    return theta.float(), simulate(task, theta, gen, noise).float()


def q_task_data(task: str, kind: str, seed: int, n: int, noise: float = 0.1) -> tuple[Tensor, Tensor]:
    """Training pairs simulated under the new prior ``new_prior(task, kind)`` restricted to the training box
    (the posterior PriorGuide targets; rejection, < 0.1 % of q lies outside any of the boxes)."""
    gen = torch.Generator().manual_seed(20_000 + 10 * seed + Q_KINDS.index(kind))
    q, box = new_prior(task, kind), train_prior(task)
    parts, got = [], 0
    while got < n:
        th = q.sample(n, gen)
        th = th[box.contains(th)]
        parts.append(th)
        got += th.shape[0]
    theta = torch.cat(parts)[:n]
    return theta.float(), simulate(task, theta, gen, noise).float()


def _versions() -> dict[str, str]:
    out = {"torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]), "build_threads": str(BUILD_THREADS)}
    try:
        import sbi

        out["sbi"] = ".".join(sbi.__version__.split(".")[:2])
    except ImportError:
        out["sbi"] = "absent"
    return out


def _path(task: str, seed: int, kind: str, recipe: dict[str, Any]):
    blob = json.dumps({"task": task, "seed": seed, "recipe": recipe, "versions": _versions()}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return cache_dir() / "priorguide" / f"{task}-s{seed}-{digest}-{kind}.safetensors"


def score_model(task: str, seed: int = 0, *, recipe: dict[str, Any] | None = None, rebuild: bool = False,
                cache: bool = True) -> pg.ScoreDiffusion:
    """Our trained score model of ``task``/``seed`` (trained on first use and cached; ``cache=False``:
    in memory only, for smoke runs with a small ``recipe``)."""
    R = dict(recipe or RECIPE)
    path = _path(task, seed, "ours", R)
    if cache and path.is_file() and not rebuild:
        return pg.ScoreDiffusion.load(path)
    theta, x = task_data(task, seed, R["n_sims"], R["noise"])
    return _fit_ours(theta, x, R, seed, path if cache else None, {"task": task, "seed": seed, "prior": "train"})


def _fit_ours(theta: Tensor, x: Tensor, R: dict[str, Any], seed: int, path: Any, meta: dict[str, Any]) -> pg.ScoreDiffusion:
    t0 = time.perf_counter()
    c0 = time.process_time()
    m = pg.ScoreDiffusion(theta.shape[1], x.shape[1], sigma_min=R["sigma_min"], sigma_max=R["sigma_max"],
                          hidden=R["ours_hidden"], layers=R["ours_layers"])
    with build_threads():
        m.fit(theta, x, steps=R["ours_steps"], batch_size=R["ours_batch"], lr=R["ours_lr"], seed=seed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        m.save(path, {**meta, "recipe": R, "final_loss": m.fit_result.final_loss,
                      "train_wall_s": time.perf_counter() - t0, "train_cpu_s": time.process_time() - c0})
        logger.info("trained PriorGuide score model %s in %.1f s", meta, time.perf_counter() - t0)
    return m


def q_score_model(task: str, kind: str, seed: int = 0, *, recipe: dict[str, Any] | None = None,
                  rebuild: bool = False, cache: bool = True) -> pg.ScoreDiffusion:
    """The "retrained on q" gold standard (spec, Baselines): our score model with the recipe of
    :func:`score_model`, trained on pairs simulated under ``new_prior(task, kind)`` (:func:`q_task_data`);
    cached like the others (``<task>-s<seed>-<hash>-q-<kind>.safetensors``)."""
    if kind not in Q_KINDS:
        raise ValueError(f"kind={kind!r}: choose from {list(Q_KINDS)}")
    R = dict(recipe or RECIPE)
    path = _path(task, seed, f"q-{kind}", R)
    if cache and path.is_file() and not rebuild:
        return pg.ScoreDiffusion.load(path)
    theta, x = q_task_data(task, kind, seed, R["n_sims"], R["noise"])
    return _fit_ours(theta, x, R, seed, path if cache else None, {"task": task, "seed": seed, "prior": kind})


def sbi_estimator(task: str, seed: int = 0, *, recipe: dict[str, Any] | None = None, rebuild: bool = False,
                  cache: bool = True) -> Any:
    """sbi's trained NPSE estimator of ``task``/``seed`` (needs sbi; cached like :func:`score_model`)."""
    from rankwise.science.priorguide import sbi_peer

    R = dict(recipe or RECIPE)
    path = _path(task, seed, "sbi", R)
    theta, x = task_data(task, seed, R["n_sims"], R["noise"])
    if cache and path.is_file() and not rebuild:
        est = sbi_peer.empty_npse(theta, x, hidden=R["sbi_hidden"], layers=R["sbi_layers"])
        state, _ = io.load_tensors(path)
        try:
            est.load_state_dict(state)
        except RuntimeError as e:
            raise ArtifactError(f"{path}: does not match the recipe's sbi estimator ({e}); rebuild") from None
        return est.eval()
    with build_threads():
        est = sbi_peer.train_npse(theta, x, train_prior(task), epochs=R["sbi_epochs"], batch_size=R["sbi_batch"],
                                  hidden=R["sbi_hidden"], layers=R["sbi_layers"], seed=seed)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        io.save_tensors(path, dict(est.state_dict()), {"task": task, "seed": seed, "recipe": R})
    return est


def build(force: bool = False, progress: bool = False, tasks: tuple[str, ...] = TASKS,
          seeds: tuple[int, ...] = BUILD_SEEDS) -> dict[str, Any]:
    """Build (or check) every cached score model; what ``rankwise zoo build`` calls for PriorGuide."""
    from rankwise.science.priorguide.sbi_peer import sbi_available

    out: dict[str, Any] = {}
    for task in tasks:
        for seed in seeds:
            t0 = time.perf_counter()
            score_model(task, seed, rebuild=force)
            rec = {"ours_s": round(time.perf_counter() - t0, 1)}
            if sbi_available():
                t0 = time.perf_counter()
                sbi_estimator(task, seed, rebuild=force)
                rec["sbi_s"] = round(time.perf_counter() - t0, 1)
            else:
                rec["sbi"] = "skipped (sbi not installed)"
            for kind in Q_KINDS:  # the "retrained on q" gold-standard rows
                t0 = time.perf_counter()
                q_score_model(task, kind, seed, rebuild=force)
                rec[f"q_{kind}_s"] = round(time.perf_counter() - t0, 1)
            out[f"{task}/s{seed}"] = rec
    return out
