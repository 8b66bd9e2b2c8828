"""The diffusion prior of DiffBCP: a diffusers ``UNet2DModel`` + ``DDPMScheduler`` (epsilon prediction).

The diffusion block of the split Gibbs sampler draws ``x ~ p(x | z) ∝ p_diff(x) N(z; x, rho^2 I)``
approximately, PnP-DM style: it treats the CP reconstruction ``z`` as a noisy image at noise level
``rho``, starts the reverse chain at the first grid step whose noise level ``sigma(t) = sqrt((1 -
abar_t) / abar_t)`` is below ``rho``, from ``sqrt(abar_t) z`` (= ``s(t) z``, ``s = 1 / sqrt(1 +
sigma^2)``), and runs the scheduler's ancestral steps to ``t = 0``.

Any object with ``image_shape`` (C, H, W) and ``denoise(z, rho, generator) -> (x, steps)`` can stand
in (the :class:`DiffusionPrior` protocol); :meth:`TinyVPDiffusion.from_diffusers` wraps a user's own
trained ``UNet2DModel`` and scheduler. diffusers is imported inside functions (an optional peer).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rankwise.core import io
from rankwise.core.errors import ArtifactError
from rankwise.core.validate import check_int, check_number

__all__ = ["DiffusionPrior", "PriorTrainResult", "TinyVPDiffusion"]

logger = logging.getLogger(__name__)


@runtime_checkable
class DiffusionPrior(Protocol):
    """What DiffBCP needs from a diffusion prior (images in [-1, 1])."""

    image_shape: tuple[int, int, int]

    def denoise(self, z: Tensor, rho: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, list[int]]:
        """``z`` [B, C, H, W], ``rho`` [B] -> (denoised images [B, C, H, W], reverse steps run per image)."""
        ...


@dataclass(frozen=True)
class PriorTrainResult:
    """How a :class:`TinyVPDiffusion` was trained: steps, final (EMA over 50 steps) loss, CPU seconds."""

    steps: int
    final_loss: float
    cpu_s: float


def _diffusers() -> Any:
    try:
        import diffusers
    except ImportError as e:  # pragma: no cover - the peer is in the science extra
        raise ImportError("the DiffBCP diffusion prior needs diffusers (pip install 'rankwise[science]')") from e
    return diffusers


class TinyVPDiffusion:
    """A small epsilon-prediction DDPM on ``C x S x S`` images in [-1, 1] (diffusers UNet2DModel).

    ``grid_steps``: the reverse time grid of the diffusion block (``DDPMScheduler.set_timesteps``);
    its noise levels ``sigma_grid`` decrease from about ``sqrt(1/abar_T)`` to ``sigma(0)`` (0.01 for the
    default linear beta schedule).
    """

    def __init__(self, unet: Any, scheduler: Any, grid_steps: int = 50) -> None:
        cfg = unet.config
        size = cfg.sample_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        self.unet = unet.eval()
        self.scheduler = scheduler
        self.image_shape: tuple[int, int, int] = (int(cfg.in_channels), int(h), int(w))
        self.train_result: PriorTrainResult | None = None
        self.set_grid(grid_steps)

    # ----------------------------------------------------------------------------------------- grid
    def set_grid(self, grid_steps: int) -> None:
        """Use ``grid_steps`` reverse steps (at most the scheduler's training steps)."""
        n_train = int(self.scheduler.config.num_train_timesteps)
        self.grid_steps = check_int("TinyVPDiffusion.grid_steps", grid_steps, 1, n_train)
        self.scheduler.set_timesteps(self.grid_steps)
        self.timesteps = [int(t) for t in self.scheduler.timesteps]
        abar = self.scheduler.alphas_cumprod.double()
        self.abar = torch.stack([abar[t] for t in self.timesteps])
        self.sigma_grid = ((1 - self.abar) / self.abar).sqrt()

    def start_index(self, rho: float) -> int:
        """Index of the first grid step whose noise level is below ``rho`` (``len(grid)``: none is)."""
        below = (self.sigma_grid < rho).nonzero()
        return int(below[0]) if len(below) else len(self.timesteps)

    def steps_for(self, rho: float) -> int:
        """Reverse steps the diffusion block runs at coupling ``rho`` (0: it returns its input)."""
        return len(self.timesteps) - self.start_index(rho)

    # -------------------------------------------------------------------------------------- denoise
    @torch.no_grad()
    def denoise(self, z: Tensor, rho: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, list[int]]:
        """Low-rank-guided denoising: each image ``z[b]`` enters the reverse chain at the first grid
        step with ``sigma(t) < rho[b]`` as ``sqrt(abar_t) z[b]``; images start at their own step and
        share the UNet calls from then on. An image whose ``rho`` is at most ``sigma`` of the last grid
        step is returned unchanged. Returns (images [B, C, H, W] float32, steps run per image)."""
        if z.dim() != 4 or tuple(z.shape[1:]) != self.image_shape:
            raise ValueError(f"TinyVPDiffusion.denoise: z must be [B, {', '.join(map(str, self.image_shape))}], "
                             f"got {list(z.shape)}")
        rho = torch.as_tensor(rho, dtype=torch.float64).reshape(-1)
        if rho.numel() != z.shape[0]:
            raise ValueError(f"TinyVPDiffusion.denoise: rho has {rho.numel()} values for {z.shape[0]} images")
        z = z.float()
        starts = [self.start_index(float(r)) for r in rho]
        n = len(self.timesteps)
        x = z.clone()
        first = min(starts)
        for i in range(first, n):
            t = self.timesteps[i]
            for b, s in enumerate(starts):
                if s == i:
                    x[b] = math.sqrt(float(self.abar[i])) * z[b]
            act = [b for b, s in enumerate(starts) if s <= i]
            xa = x[act]
            eps = self.unet(xa, torch.full((len(act),), t, dtype=torch.long)).sample
            x[act] = self.scheduler.step(eps, t, xa, generator=generator).prev_sample
        return x, [n - s for s in starts]

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` unconditional samples (the full reverse chain from pure noise)."""
        x = torch.randn((n, *self.image_shape), generator=generator)
        for t in self.timesteps:
            eps = self.unet(x, torch.full((n,), t, dtype=torch.long)).sample
            x = self.scheduler.step(eps, t, x, generator=generator).prev_sample
        return x

    # ------------------------------------------------------------------------------------ building
    @classmethod
    def build(cls, image_size: int = 16, channels: int = 1, block_out_channels: tuple[int, ...] = (16, 32, 32),
              num_train_timesteps: int = 1000, grid_steps: int = 50, seed: int = 0) -> "TinyVPDiffusion":
        """An untrained model: a UNet2DModel with plain ResNet blocks and a linear-beta DDPM scheduler."""
        d = _diffusers()
        check_int("TinyVPDiffusion.image_size", image_size, 4)
        check_int("TinyVPDiffusion.channels", channels, 1)
        if image_size % (2 ** (len(block_out_channels) - 1)):
            raise ValueError(f"TinyVPDiffusion.image_size must be divisible by 2^(levels - 1) = "
                             f"{2 ** (len(block_out_channels) - 1)}, got {image_size}")
        n = len(block_out_channels)
        with torch.random.fork_rng():  # the UNet's initial weights from ``seed``, the global RNG untouched
            torch.manual_seed(seed)
            unet = d.UNet2DModel(sample_size=image_size, in_channels=channels, out_channels=channels,
                                 block_out_channels=tuple(block_out_channels), layers_per_block=1,
                                 down_block_types=("DownBlock2D",) * n, up_block_types=("UpBlock2D",) * n,
                                 norm_num_groups=min(8, min(block_out_channels)))
        sched = d.DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule="linear",
                                prediction_type="epsilon", clip_sample=True)
        return cls(unet, sched, grid_steps)

    @classmethod
    def from_diffusers(cls, unet: Any, scheduler: Any, grid_steps: int = 50) -> "TinyVPDiffusion":
        """Wrap a user's own trained ``UNet2DModel`` and DDPM-type scheduler (epsilon prediction)."""
        if getattr(scheduler.config, "prediction_type", "epsilon") != "epsilon":
            raise ValueError(f"TinyVPDiffusion needs an epsilon-prediction scheduler, got "
                             f"prediction_type={scheduler.config.prediction_type!r}")
        return cls(unet, scheduler, grid_steps)

    @classmethod
    def train(cls, images: Tensor, steps: int = 3000, batch_size: int = 32, lr: float = 2e-3, seed: int = 0,
              block_out_channels: tuple[int, ...] = (16, 32, 32), grid_steps: int = 50) -> "TinyVPDiffusion":
        """Train on ``images`` [N, C, S, S] in [-1, 1] by denoising score matching (epsilon MSE), AdamW
        with a cosine decay and gradient clipping at 1; deterministic for a seed on one machine."""
        if images.dim() != 4 or images.shape[2] != images.shape[3]:
            raise ValueError(f"TinyVPDiffusion.train: images must be [N, C, S, S], got {list(images.shape)}")
        if not torch.isfinite(images).all() or images.min() < -1.0 - 1e-6 or images.max() > 1.0 + 1e-6:
            raise ValueError("TinyVPDiffusion.train: images must be finite and scaled to [-1, 1]")
        check_int("TinyVPDiffusion.steps", steps, 1)
        check_int("TinyVPDiffusion.batch_size", batch_size, 1)
        check_number("TinyVPDiffusion.lr", lr, 0.0, low_open=True)
        m = cls.build(int(images.shape[2]), int(images.shape[1]), block_out_channels, grid_steps=grid_steps, seed=seed)
        unet, sched = m.unet.train(), m.scheduler
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.0)
        lr_at = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + math.cos(math.pi * k / steps)))
        data = images.float()
        c0, ema = time.process_time(), None
        n_train = int(sched.config.num_train_timesteps)
        for _ in range(steps):
            idx = torch.randint(0, len(data), (batch_size,), generator=gen)
            x0 = data[idx]
            noise = torch.randn(x0.shape, generator=gen)
            t = torch.randint(0, n_train, (batch_size,), generator=gen)
            loss = torch.nn.functional.mse_loss(unet(sched.add_noise(x0, noise, t), t).sample, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            opt.step()
            lr_at.step()
            lv = loss.item()
            ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        m.unet.eval()
        m.train_result = PriorTrainResult(steps, float(ema), time.process_time() - c0)
        return m

    # ---------------------------------------------------------------------------------------- I/O
    def save(self, path: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """Weights and both configs in one safetensors file (atomic; JSON metadata, nothing pickled)."""
        meta = {"unet_config": _jsonable(dict(self.unet.config)), "scheduler_config": _jsonable(dict(self.scheduler.config)),
                "grid_steps": self.grid_steps, "image_shape": list(self.image_shape), **(metadata or {})}
        if self.train_result is not None:
            meta["train"] = {"steps": self.train_result.steps, "final_loss": self.train_result.final_loss,
                             "cpu_s": self.train_result.cpu_s}
        return io.save_tensors(path, dict(self.unet.state_dict()), meta)

    @classmethod
    def load(cls, path: str | Path) -> "TinyVPDiffusion":
        d = _diffusers()
        state, meta = io.load_tensors(path)
        if "unet_config" not in meta or "scheduler_config" not in meta:
            raise ArtifactError(f"{path}: not a TinyVPDiffusion file (no unet/scheduler config in its metadata)")
        unet = d.UNet2DModel.from_config(meta["unet_config"])
        try:
            unet.load_state_dict(state)
        except RuntimeError as e:
            raise ArtifactError(f"{path}: weights do not fit the stored UNet config ({e})") from None
        m = cls(unet, d.DDPMScheduler.from_config(meta["scheduler_config"]), int(meta.get("grid_steps", 50)))
        if "train" in meta:
            tr = meta["train"]
            m.train_result = PriorTrainResult(int(tr["steps"]), float(tr["final_loss"]), float(tr["cpu_s"]))
        return m


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)
