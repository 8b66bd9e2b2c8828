"""CondiQuant: the cost of conditioning one layer, and the zero inference overhead of a conditioned model.

* ``condiquant_conditioning`` (anchor: one ``torch.linalg.svd`` of the same matrix): CondiQuant's K = 100
  proximal gradient steps on one ``n x m = 256 x 512`` weight with ``H = X^T X`` precomputed (spread and
  shave prox, one lambda; the lambda search multiplies this by the number of grid values tried). Each step is
  one SVD plus an ``n^2 m`` product, so about 100 anchors is the expected ratio.
* ``condiquant_sr_forward`` (anchor: an FP SR-shaped conv stack with the reproduction's layer sizes, seeded
  random weights: head conv3x3(1 -> C), ``blocks`` x [depthwise 3x3, 1x1 C -> 2C, GELU, 1x1 2C -> C], tail
  conv3x3(C -> 4) + PixelShuffle(2); C = 48, 3 blocks; 32 LR images 16 x 16; benchmarks may not import
  ``repro``, so the stack is built here without the residuals): the same net after ``condition_model`` (no
  module added: the goal is <= 1.1x the anchor), and its W3A3 fake-quantized copy from ``ptq_quantize``
  (MinMax; the rounding is torch's ``fake_quantize_per_*_affine``, the torch.ao kernels).
* ``SMOKE_CASES``: 32 x 64 conditioning and a 1-block C = 8 net, once each.

Run ``python -m benchmarks.run condiquant``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from benchmarks.harness import Case, Goal

def TARGET(name: str, m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1)


def _problem(n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4 * n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -4, n, dtype=torch.float64)
    return torch.randn(n, m, generator=g, dtype=torch.float64), X.T @ X


def _svd(n: int, m: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        W0, _ = _problem(n, m)
        return lambda: torch.linalg.svd(W0, full_matrices=False)
    return factory


def _condition(n: int, m: int, prox: str, iters: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.compress.condiquant import condition_matrix

        W0, H = _problem(n, m)
        return lambda: condition_matrix(W0, H, 1e-3, prox=prox, max_iters=iters)
    return factory


def _net(channels: int, blocks: int) -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]:
    nn = torch.nn
    c = channels
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(1, c, 3, padding=1)]
    for _ in range(blocks):
        layers += [nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, 2 * c, 1), nn.GELU(), nn.Conv2d(2 * c, c, 1)]
    net = nn.Sequential(*layers, nn.Conv2d(c, 4, 3, padding=1), nn.PixelShuffle(2)).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.rand(8, 1, 16, 16, generator=g) for _ in range(2)]
    return net, calib, torch.rand(32, 1, 16, 16, generator=g)


def _forward(channels: int, blocks: int, kind: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.compress.condiquant import CondiQuantConfig, condition_model, ptq_quantize

        net, calib, x = _net(channels, blocks)
        if kind == "conditioned":
            net = copy.deepcopy(net)
            condition_model(net, calib, CondiQuantConfig(target=TARGET, max_rel_output_err=1e-2, max_iters=20))
        elif kind == "w3a3":
            net = ptq_quantize(net, calib, 3, 3, target=TARGET)

        def run() -> Any:
            with torch.no_grad():
                return net(x)
        return run
    return factory


def _cases(n: int, m: int, iters: int, channels: int, blocks: int, repeats: int, suffix: str = "") -> list[Case]:
    cond = Case(f"condiquant_conditioning{suffix}",
                {"torch.linalg.svd": _svd(n, m), "CondiQuant spread": _condition(n, m, "spread", iters),
                 "CondiQuant shave": _condition(n, m, "shave", iters)},
                anchor="torch.linalg.svd", params={"n": n, "m": m, "K": iters, "dtype": "float64"},
                repeats=repeats, warmup=1 if repeats > 1 else 0)
    fwd = Case(f"condiquant_sr_forward{suffix}",
               {"FP": _forward(channels, blocks, "fp"), "conditioned FP": _forward(channels, blocks, "conditioned"),
                "W3A3 fake-quant": _forward(channels, blocks, "w3a3")},
               anchor="FP", params={"channels": channels, "blocks": blocks, "batch": "32 x 1 x 16 x 16"},
               repeats=repeats * 2, warmup=1 if repeats > 1 else 0,
               goals=(Goal("a conditioned model costs nothing at inference (<= 1.1x FP)", impl="conditioned FP",
                           max_ratio=1.1),) if repeats > 1 else ())
    return [cond, fwd]


CASES = _cases(256, 512, 100, 48, 3, repeats=5)
SMOKE_CASES = _cases(32, 64, 5, 8, 1, repeats=1, suffix="_smoke")
