"""Token dynamics in torch: a trainable deep stochastic Transformer on the sphere (:class:`SphereTransformer`),
the value re-initialisation hook for any torch Transformer (:class:`StochasticValueInit`) and the
cosine Gram matrices of hidden states (:func:`hidden_state_grams`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rankwise.core.errors import SelectionError
from rankwise.core.validate import check_int, check_number


# --------------------------------------------------------------------------------------------------
# Torch: a trainable deep stochastic Transformer and the value re-initialisation hook


class _SphereLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query = nn.Linear(dim, dim, bias=False)
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim, bias=False)


class SphereTransformer(nn.Module):
    """A deep attention-only Transformer with the paper's layer: post-RMS-norm and ``1/sqrt(depth)`` residual.

    ``x <- RMSNorm(x + depth^{-1/2} V softmax(x Q^T K x^T / d) x)`` for ``depth`` layers; tokens live on the
    sphere of radius ``sqrt(dim)`` (RMSNorm without gain). Embeddings + learned positions, read-out of
    token 0 by a linear head. ``value_scale`` / ``value_mean`` set the value matrices at init:
    ``V = value_mean * I + value_scale * N(0, 1/dim)`` (``(0, 1)``: standard random init, the paper's
    "noise on"; ``(1, 0)``: ``V = I``, "noise off"). Input ``(B, L)`` token ids, output ``(B, n_classes)``.
    """

    def __init__(self, vocab: int, dim: int = 32, depth: int = 8, n_classes: int = 2, max_len: int = 64,
                 value_scale: float = 1.0, value_mean: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        for name, v in (("vocab", vocab), ("dim", dim), ("depth", depth), ("n_classes", n_classes),
                        ("max_len", max_len)):
            check_int(f"SphereTransformer.{name}", v, 1)
        check_number("SphereTransformer.value_scale", value_scale)
        check_number("SphereTransformer.value_mean", value_mean)
        g = torch.Generator().manual_seed(int(seed))
        self.dim, self.depth = dim, depth
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.layers = nn.ModuleList(_SphereLayer(dim) for _ in range(depth))
        self.head = nn.Linear(dim, n_classes)
        with torch.no_grad():
            self.embed.weight.normal_(0.0, 1.0, generator=g)
            self.pos.normal_(0.0, 0.1, generator=g)
            for layer in self.layers:
                layer.query.weight.normal_(0.0, dim ** -0.5, generator=g)
                layer.key.weight.normal_(0.0, dim ** -0.5, generator=g)
                layer.value.weight.normal_(0.0, dim ** -0.5, generator=g).mul_(value_scale)
                layer.value.weight.add_(value_mean * torch.eye(dim))
            self.head.weight.normal_(0.0, dim ** -0.5, generator=g)
            self.head.bias.zero_()

    @staticmethod
    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp_min(1e-12))

    def hidden_states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The token states ``(B, L, dim)`` after the embedding and after every layer (``depth + 1`` tensors)."""
        if ids.ndim != 2 or ids.shape[1] > self.pos.shape[0]:
            raise ValueError(f"ids must have shape (batch, length <= {self.pos.shape[0]}), got {tuple(ids.shape)}")
        x = self.rms(self.embed(ids) + self.pos[: ids.shape[1]])
        out = [x]
        scale = self.depth ** -0.5
        for layer in self.layers:
            s = layer.query(x) @ layer.key(x).transpose(1, 2) / self.dim
            x = self.rms(x + scale * layer.value(torch.softmax(s, dim=-1) @ x))
            out.append(x)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden_states(ids)[-1][:, 0])


_VALUE_NAMES = ("v_proj", "value", "v", "to_v", "v_lin", "wv")


class StochasticValueInit:
    """Re-initialise the value projections of a torch Transformer with the paper's random values.

    ``V <- mean * I + scale * N(0, 1/d_in)`` entry-wise, independently per layer (spec "Also
    ``StochasticValueInit(model, scale=1.0)``"). Found automatically (or pass ``target``, any
    :func:`rankwise.core.select.select` selector):

    * ``nn.Linear`` modules whose name ends in ``v_proj``, ``value``, ``v``, ``to_v``, ``v_lin`` or
      ``wv`` (Llama, BERT, T5, diffusers, DistilBERT, ...), the ``value`` of :class:`SphereTransformer`;
    * GPT-2 ``c_attn`` (``Conv1D``, fused q|k|v): the last third of its output columns;
    * ``nn.MultiheadAttention``: the value rows of ``in_proj_weight`` (or ``v_proj_weight``).

    Biases of the value projections are zeroed. Construction applies the change in place;
    ``names`` lists what changed. ``mean != 0`` needs square value matrices. The change is all or
    nothing: the new weights are computed for every module before any is written.
    """

    def __init__(self, model: nn.Module, scale: float = 1.0, mean: float = 0.0, seed: int = 0,
                 target: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.scale = check_number("scale", scale, 0.0)
        self.mean = check_number("mean", mean)
        g = torch.Generator().manual_seed(int(seed))
        plan = self._plan(model, target)
        writes: list[tuple[torch.Tensor, tuple[slice, slice] | None, torch.Tensor, torch.Tensor | None]] = []
        for name, param, region, layout, bias, bias_region in plan:
            w = param.detach() if region is None else param.detach()[region]
            # layout "out_in": W is (d_out, d_in) and y = W x; "in_out": W is (d_in, d_out) (GPT-2 Conv1D)
            d_out, d_in = (w.shape if layout == "out_in" else (w.shape[1], w.shape[0]))
            if self.mean != 0 and d_out != d_in:
                raise ValueError(f"mean={self.mean} needs a square value matrix; {name} is {d_out} x {d_in}")
            new = torch.randn((d_out, d_in), generator=g, dtype=torch.float64) * (self.scale / math.sqrt(d_in))
            if self.mean != 0:
                new += self.mean * torch.eye(d_in, dtype=torch.float64)
            if layout == "in_out":
                new = new.T
            writes.append((param, region, new.to(param.dtype), None))
            if bias is not None:
                writes.append((bias, bias_region, torch.zeros_like(bias.detach() if bias_region is None
                                                                   else bias.detach()[bias_region]), None))
        with torch.no_grad():
            for param, region, new, _ in writes:
                if region is None:
                    param.copy_(new)
                else:
                    param[region] = new
        self.names = [p[0] for p in plan]

    @staticmethod
    def _plan(model: nn.Module, target: Any) -> list[tuple[str, torch.Tensor, Any, str, Any, Any]]:
        plan: list[tuple[str, torch.Tensor, Any, str, Any, Any]] = []
        if target is not None:
            from rankwise.core.select import select

            for name, mod in select(model, target):
                if not isinstance(mod, nn.Linear):
                    raise SelectionError(f"target {name} is a {type(mod).__name__}; StochasticValueInit re-initialises "
                                         "nn.Linear value projections (leave target=None for GPT-2 / MultiheadAttention)")
                plan.append((name, mod.weight, None, "out_in", mod.bias, None))
            return plan
        for name, mod in model.named_modules():
            last = name.rsplit(".", 1)[-1]
            if isinstance(mod, nn.Linear) and last in _VALUE_NAMES:
                plan.append((name, mod.weight, None, "out_in", mod.bias, None))
            elif isinstance(mod, nn.MultiheadAttention):
                if mod.in_proj_weight is not None:
                    E = mod.embed_dim
                    plan.append((name + ".in_proj_weight[v]", mod.in_proj_weight, (slice(2 * E, 3 * E), slice(None)),
                                 "out_in", mod.in_proj_bias, (slice(2 * E, 3 * E),) if mod.in_proj_bias is not None
                                 else None))
                else:
                    plan.append((name + ".v_proj_weight", mod.v_proj_weight, None, "out_in", None, None))
            elif last == "c_attn" and type(mod).__name__ == "Conv1D":
                w = mod.weight  # (d_in, 3 d)
                d3 = w.shape[1]
                if d3 % 3:
                    raise SelectionError(f"{name}: fused c_attn width {d3} is not divisible by 3")
                d = d3 // 3
                plan.append((name + "[v]", w, (slice(None), slice(2 * d, 3 * d)), "in_out", mod.bias,
                             (slice(2 * d, 3 * d),)))
        if not plan:
            raise SelectionError("no value projection found (looked for nn.Linear named "
                                 f"{'/'.join(_VALUE_NAMES)}, GPT-2 c_attn, nn.MultiheadAttention); pass target=")
        return plan

    def __repr__(self) -> str:
        return f"StochasticValueInit(scale={self.scale}, mean={self.mean}, modules={len(self.names)})"


@torch.no_grad()
def hidden_state_grams(model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Cosine Gram matrices of the token states at every depth, ``(n_layers + 1, B, L, L)``, float64.

    Works with :class:`SphereTransformer` (``hidden_state_grams(model, ids)``) and any Hugging Face
    model that accepts ``output_hidden_states=True`` (``hidden_state_grams(model, input_ids=ids)``).
    Entries near -1 reveal antipodal token pairs, near +1 clusters.
    """
    if isinstance(model, SphereTransformer):
        states = model.hidden_states(*args, **kwargs)
    else:
        out = model(*args, output_hidden_states=True, **kwargs)
        states = getattr(out, "hidden_states", None)
        if states is None:
            raise TypeError(f"{type(model).__name__} did not return hidden_states; pass a Hugging Face model or a "
                            "SphereTransformer")
    grams = []
    for h in states:
        u = h.to(torch.float64)
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        grams.append(u @ u.transpose(-1, -2))
    return torch.stack(grams)
