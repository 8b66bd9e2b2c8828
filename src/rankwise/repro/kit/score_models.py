"""PriorGuide's trained score models, built once by a fixed recipe and cached (``rankwise zoo build``).

For each task (``gaussian_linear``, ``two_moons``, ``sir``) and seed: ``N`` pairs simulated under the
training prior (``Uniform[-3, 3]^2``; two moons ``Uniform[-1, 1]^2``; SIR ``(beta, gamma)`` in
``[1, 4] x [0.5, 2]`` per week, 10 weekly noisy infected fractions), then

* our :class:`~rankwise.science.priorguide.ScoreDiffusion` (MLP 4 x 64, ``sigma`` in [0.01, 5]),
  denoising score matching, Adam with cosine decay (``ours_*`` of :data:`RECIPE`);
* sbi's NPSE (VE SDE, MLP score network) on the same pairs (``sbi_*``), when sbi is installed.

Files: ``cache_dir()/priorguide/<task>-s<seed>-<hash>-{ours,sbi}.safetensors``; the hash covers the
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

__all__ = ["RECIPE", "TASKS", "build", "sbi_estimator", "score_model", "task_data", "train_prior"]

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


def train_prior(task: str) -> pg.BoxUniform:
    if task == "gaussian_linear":
        return pg.BoxUniform(-3 * torch.ones(2), 3 * torch.ones(2))
    if task == "two_moons":
        return pg.BoxUniform(-torch.ones(2), torch.ones(2))
    if task == "sir":
        return pg.BoxUniform(torch.tensor([1.0, 0.5]), torch.tensor([4.0, 2.0]))
    raise ValueError(f"task={task!r} is not a PriorGuide task; choose from {list(TASKS)}")


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


def _versions() -> dict[str, str]:
    out = {"torch": ".".join(torch.__version__.split("+")[0].split(".")[:2])}
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
    t0 = time.perf_counter()
    m = pg.ScoreDiffusion(theta.shape[1], x.shape[1], sigma_min=R["sigma_min"], sigma_max=R["sigma_max"],
                          hidden=R["ours_hidden"], layers=R["ours_layers"])
    m.fit(theta, x, steps=R["ours_steps"], batch_size=R["ours_batch"], lr=R["ours_lr"], seed=seed)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        m.save(path, {"task": task, "seed": seed, "recipe": R, "final_loss": m.fit_result.final_loss,
                      "train_wall_s": time.perf_counter() - t0})
        logger.info("trained PriorGuide score model %s seed %d in %.1f s", task, seed, time.perf_counter() - t0)
    return m


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
            out[f"{task}/s{seed}"] = rec
    return out
