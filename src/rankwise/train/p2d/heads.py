"""Attention heads as parameter slices: discovery, ALPS head scores, selection, gradient masks, save/load.

Head ``(l, h)`` of a layer with ``H`` query heads, ``G`` key/value heads and head size ``d_h`` owns

* rows ``h*d_h:(h+1)*d_h`` of ``W_q`` (and of its bias), the rows of its key/value group
  ``g = h // (H / G)`` in ``W_k`` and ``W_v`` (shared by the ``H / G`` query heads of the group), and
* columns ``h*d_h:(h+1)*d_h`` of ``W_o`` (``o_proj``'s input features; ``o_proj``'s bias is shared by
  every head and never belongs to one).

Supported layouts (:func:`find_attention`): modules with ``q_proj``/``k_proj``/``v_proj``/``o_proj``
children (Llama, Mistral, Qwen2, OPT, ...) and GPT-2's fused ``c_attn``/``c_proj`` (``Conv1D``,
weights stored ``(in, out)``). Other architectures register a finder with
:func:`register_attention_finder`.

ALPS score (spec step 1): the head's vector ``u = [vec(Q_h); vec(K_h); vec(V_h)]`` (each slice as
``(d_h, d_model)``, row-major; ``W_o`` is not part of it) becomes ``P = softmax(u^0)`` and
``Q = softmax(u^p)`` over its ``n`` positions (float32), and the score is the 1-D Wasserstein-1
distance on the support ``x_i = i / (n - 1)``::

    W1(P, Q) = 1 / (n - 1) * sum_{i < n-1} | F_P(i) - F_Q(i) |          (F: cumulative sums, float64)

which is ``scipy.stats.wasserstein_distance(x, x, P, Q)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from rankwise.core.errors import ArtifactError
from rankwise.core.validate import check_choice, check_number

__all__ = [
    "HEAD_SCORES",
    "AttentionLayout",
    "HeadRestriction",
    "HeadSelection",
    "distribution_distance",
    "find_attention",
    "head_count",
    "head_mask",
    "head_scores",
    "head_vector",
    "load_heads",
    "register_attention_finder",
    "restrict_to_heads",
    "save_heads",
    "select_heads",
    "wasserstein1",
]

HEAD_SCORES = ("wasserstein", "kl", "js", "cosine", "update_norm")
SUPPORTED = ("q_proj/k_proj/v_proj/o_proj (Llama, Mistral, Qwen2, OPT, ...)", "GPT-2 c_attn/c_proj")
EPS = 1e-8


@dataclass
class AttentionLayout:
    """One attention layer's projections and head geometry.

    ``q``, ``k``, ``v``, ``o``: the modules (``k``/``v`` are ``q`` itself for GPT-2's fused ``c_attn``);
    ``fused``: GPT-2 layout (Conv1D, weight ``(in, out)``, q/k/v side by side in ``c_attn``'s output).
    """

    name: str
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    fused: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def row_slices(self, h: int) -> list[tuple[nn.Module, int]]:
        """``(module, first output feature)`` of head ``h``'s Q, K, V slices (each ``head_dim`` features)."""
        g = h // self.group
        if self.fused:
            d = self.num_heads * self.head_dim
            return [(self.q, h * self.head_dim), (self.q, d + g * self.head_dim), (self.q, 2 * d + g * self.head_dim)]
        return [(self.q, h * self.head_dim), (self.k, g * self.head_dim), (self.v, g * self.head_dim)]

    def out_weight(self, module: nn.Module) -> torch.Tensor:
        """``module``'s weight as ``(out_features, in_features)`` (a view; transposed for Conv1D)."""
        return module.weight.T if self.fused else module.weight


FinderFn = Callable[[nn.Module], "list[AttentionLayout] | None"]
_FINDERS: list[FinderFn] = []


def register_attention_finder(fn: FinderFn) -> FinderFn:
    """Add ``fn(model) -> list[AttentionLayout] | None`` (None: not my architecture), tried before the built-in
    finders; returns ``fn`` so it can be used as a decorator."""
    if not callable(fn):
        raise TypeError("register_attention_finder(fn): fn must be callable")
    _FINDERS.insert(0, fn)
    return fn


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _geometry(model: nn.Module, attn: nn.Module, width: int) -> tuple[int, int, int]:
    """``(H, G, d_h)``; ``width`` is the total width of the query heads (``H * d_h``)."""
    cfg = _config(model)
    H = getattr(attn, "num_heads", None) or getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    G = getattr(attn, "num_key_value_heads", None) or getattr(cfg, "num_key_value_heads", None) or H
    if not H:
        raise ValueError("cannot find the number of attention heads (model.config.num_attention_heads or n_head)")
    H, G = int(H), int(G)
    if width % H:
        raise ValueError(f"hidden size {width} is not divisible by the number of heads {H}")
    if H % G:
        raise ValueError(f"{H} query heads are not a multiple of {G} key/value heads")
    return H, G, width // H


def _find_qkvo(model: nn.Module) -> list[AttentionLayout] | None:
    out = []
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        if all(k in kids for k in ("q_proj", "k_proj", "v_proj")) and ("o_proj" in kids or "out_proj" in kids):
            o = kids.get("o_proj", kids.get("out_proj"))
            q = kids["q_proj"]
            if not isinstance(q, nn.Linear) or not isinstance(o, nn.Linear):
                continue
            H, G, d_h = _geometry(model, mod, q.out_features)
            if q.out_features != H * d_h or kids["k_proj"].out_features != G * d_h or o.in_features != H * d_h:
                raise ValueError(f"{name}: projection sizes do not match {H} heads x {d_h} ({G} key/value heads)")
            out.append(AttentionLayout(name, q, kids["k_proj"], kids["v_proj"], o, H, G, d_h, q.in_features))
    return out or None


def _find_gpt2(model: nn.Module) -> list[AttentionLayout] | None:
    out = []
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        if "c_attn" in kids and "c_proj" in kids and type(kids["c_attn"]).__name__ == "Conv1D":
            w = kids["c_attn"].weight  # (in, 3 * out)
            hidden = w.shape[0]
            H, _, d_h = _geometry(model, mod, hidden)
            if w.shape[1] != 3 * H * d_h:
                raise ValueError(f"{name}.c_attn: {w.shape[1]} outputs, expected 3 x {H} x {d_h}")
            c = kids["c_attn"]
            out.append(AttentionLayout(name, c, c, c, kids["c_proj"], H, H, d_h, hidden, fused=True))
    return out or None


def find_attention(model: nn.Module) -> list[AttentionLayout]:
    """The attention layers of ``model`` in module order; ValueError naming the supported layouts otherwise."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for fn in [*_FINDERS, _find_qkvo, _find_gpt2]:
        found = fn(model)
        if found:
            return list(found)
    raise ValueError(f"no attention projections found in {type(model).__name__}; supported: {'; '.join(SUPPORTED)}. "
                     "Register other layouts with rankwise.train.p2d.register_attention_finder(fn)")


# --------------------------------------------------------------------------------------------------
# scores


def head_vector(layout: AttentionLayout, h: int) -> torch.Tensor:
    """ALPS's ``u = [vec(Q_h); vec(K_h); vec(V_h)]`` of head ``h`` (float32, length ``3 * d_h * d_model``)."""
    parts = []
    for mod, start in layout.row_slices(h):
        w = layout.out_weight(mod)[start:start + layout.head_dim]
        parts.append(w.detach().float().reshape(-1))
    return torch.cat(parts)


def wasserstein1(p: torch.Tensor, q: torch.Tensor) -> float:
    """W1 between two distributions on the common support ``x_i = i / (n - 1)`` (closed form, float64).

    Both are renormalised to sum 1 in float64 first: a float32 softmax sums to 1 only up to ~1e-7, which
    matters when the two distributions are close (a small W1 is a difference of nearly equal CDFs).
    """
    if p.shape != q.shape or p.dim() != 1 or p.numel() < 2:
        raise ValueError(f"wasserstein1 needs two 1-D distributions of the same length >= 2, got {tuple(p.shape)}, "
                         f"{tuple(q.shape)}")
    n = p.numel()
    p, q = p.double(), q.double()
    d = torch.cumsum(p / p.sum(), 0) - torch.cumsum(q / q.sum(), 0)  # renormalised in float64, as scipy does
    return float(d[:-1].abs().sum() / (n - 1))


def _kl(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() + EPS, b.double() + EPS
    a, b = a / a.sum(), b / b.sum()
    return float((a * (a.log() - b.log())).sum())


def distribution_distance(u0: torch.Tensor, up: torch.Tensor, kind: str = "wasserstein") -> float:
    """The head score between the "before" and "after" head vectors (spec step 1; ``kind`` in :data:`HEAD_SCORES`).

    ``wasserstein``: W1 of the softmaxes; ``kl``: KL(Q || P); ``js``: Jensen-Shannon; ``cosine``:
    ``1 - cos(P, Q)`` (eps 1e-8 smoothing for KL/JS); ``update_norm``: ``||u^p - u^0|| / ||u^0||``
    (no softmax). Identical vectors score exactly 0.
    """
    check_choice("head_score", kind, HEAD_SCORES)
    if torch.equal(u0, up):
        return 0.0
    if kind == "update_norm":
        return float((up.double() - u0.double()).norm() / u0.double().norm().clamp_min(1e-30))
    P, Q = torch.softmax(u0.float(), 0), torch.softmax(up.float(), 0)
    if kind == "wasserstein":
        return wasserstein1(P, Q)
    if kind == "kl":
        return _kl(Q, P)
    if kind == "js":
        M = 0.5 * (P.double() + Q.double())
        return 0.5 * _kl(P, M) + 0.5 * _kl(Q, M)
    Pd, Qd = P.double(), Q.double()
    return float(1.0 - (Pd @ Qd) / (Pd.norm() * Qd.norm()))


def head_scores(before: nn.Module, after: nn.Module, kind: str = "wasserstein") -> torch.Tensor:
    """``(L, H)`` float64 scores of every head between two copies of one architecture."""
    la, lb = find_attention(before), find_attention(after)
    if len(la) != len(lb) or any(a.num_heads != b.num_heads for a, b in zip(la, lb)):
        raise ValueError("head_scores: the two models have different attention layouts")
    H = la[0].num_heads
    if any(a.num_heads != H for a in la):
        raise ValueError("head_scores: every attention layer must have the same number of heads")
    s = torch.zeros(len(la), H, dtype=torch.float64)
    for i, (a, b) in enumerate(zip(la, lb)):
        for h in range(H):
            s[i, h] = distribution_distance(head_vector(a, h), head_vector(b, h), kind)
    return s


def head_count(fraction: float, total: int, what: str = "head_fraction") -> int:
    """``max(1, floor(fraction * total))``: how many heads a fraction selects (ValueError outside (0, 1])."""
    check_number(what, fraction, 0.0, 1.0, low_open=True)
    return max(1, int(math.floor(fraction * total + 1e-9)))


def select_heads(scores: torch.Tensor, fraction: float) -> list[tuple[int, int, float]]:
    """Top ``max(1, floor(fraction * L * H))`` heads by score, ranked globally; ties by (layer, head).

    Returns ``[(layer, head, score), ...]`` best first.
    """
    if scores.dim() != 2 or scores.numel() == 0:
        raise ValueError(f"scores must be a non-empty (L, H) tensor, got shape {tuple(scores.shape)}")
    if not torch.isfinite(scores).all():
        raise ValueError("head scores contain NaN or inf")
    k = head_count(fraction, scores.numel(), "head_fraction")
    L, H = scores.shape
    order = sorted(((float(scores[l, h]), l, h) for l in range(L) for h in range(H)), key=lambda t: (-t[0], t[1], t[2]))
    return [(l, h, s) for s, l, h in order[:k]]


def head_mask(heads: Sequence[tuple[int, ...]], num_layers: int, num_heads: int) -> torch.Tensor:
    """``(L, H)`` bool mask of ``heads`` (``(layer, head, ...)`` tuples)."""
    m = torch.zeros(num_layers, num_heads, dtype=torch.bool)
    for t in heads:
        l, h = int(t[0]), int(t[1])
        if not (0 <= l < num_layers and 0 <= h < num_heads):
            raise ValueError(f"head ({l}, {h}) is outside the model's {num_layers} x {num_heads} heads")
        m[l, h] = True
    return m


# --------------------------------------------------------------------------------------------------
# gradient masks


def _masks(layout: AttentionLayout, sel: torch.Tensor) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Parameter name -> (parameter, 0/1 mask of the same shape) for one layer's selected heads ``sel`` (H,)."""
    d, H = layout.head_dim, layout.num_heads
    kv = sel.view(layout.num_kv_heads, layout.group).any(1)  # GQA: a K/V slice is kept if any query head is
    rows_q = sel.repeat_interleave(d)
    rows_kv = kv.repeat_interleave(d)
    out: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}

    def add(key: str, p: nn.Parameter | None, mask: torch.Tensor) -> None:
        if p is not None:
            out[key] = (p, mask.to(p.dtype).expand_as(p).contiguous())

    if layout.fused:  # c_attn: weight (in, 3*H*d), bias (3*H*d,)
        cols = torch.cat([rows_q, rows_kv, rows_kv])
        add("q.weight", layout.q.weight, cols[None, :])
        add("q.bias", getattr(layout.q, "bias", None), cols)
        add("o.weight", layout.o.weight, rows_q[:, None])  # c_proj weight (in = H*d, out)
        return out
    add("q.weight", layout.q.weight, rows_q[:, None])
    add("k.weight", layout.k.weight, rows_kv[:, None])
    add("v.weight", layout.v.weight, rows_kv[:, None])
    for key, mod, rows in (("q.bias", layout.q, rows_q), ("k.bias", layout.k, rows_kv), ("v.bias", layout.v, rows_kv)):
        add(key, getattr(mod, "bias", None), rows)
    add("o.weight", layout.o.weight, rows_q[None, :])
    return out


@dataclass
class HeadRestriction:
    """What :func:`restrict_to_heads` changed: the gradient hooks and every parameter's former ``requires_grad``.

    ``masks``: parameter -> its 0/1 gradient mask; ``trainable``: number of entries left trainable.
    ``remove()`` takes the hooks away and restores ``requires_grad`` (also a context manager).
    """

    masks: dict[nn.Parameter, torch.Tensor]
    handles: list[Any] = field(default_factory=list)
    previous: dict[nn.Parameter, bool] = field(default_factory=dict)

    @property
    def trainable(self) -> int:
        return int(sum(float(m.sum()) for m in self.masks.values()))

    def parameters(self) -> list[nn.Parameter]:
        return list(self.masks)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for p, flag in self.previous.items():
            p.requires_grad_(flag)

    def __enter__(self) -> "HeadRestriction":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def restrict_to_heads(model: nn.Module, heads: Sequence[tuple[int, ...]] | torch.Tensor) -> HeadRestriction:
    """Freeze everything of ``model`` but the selected heads' Q/K/V rows and O columns (spec step 5).

    ``heads``: ``[(layer, head, ...), ...]`` or an ``(L, H)`` bool mask. Every other parameter gets
    ``requires_grad=False``; the attention projections keep ``requires_grad=True`` with a gradient hook
    that zeroes the entries of unselected heads (K/V slices: GQA rule). With a fresh optimizer and no
    weight decay on those tensors (AdamW ``weight_decay=0``) a step changes exactly the selected slices;
    weight decay would also shrink the masked entries, so :class:`~rankwise.train.p2d.P2D` trains
    without it.
    """
    layouts = find_attention(model)
    L, H = len(layouts), layouts[0].num_heads
    sel = heads.bool() if isinstance(heads, torch.Tensor) else head_mask(heads, L, H)
    if tuple(sel.shape) != (L, H):
        raise ValueError(f"head mask must be shaped ({L}, {H}), got {tuple(sel.shape)}")
    if not sel.any():
        raise ValueError("restrict_to_heads: no head selected")
    masks: dict[nn.Parameter, torch.Tensor] = {}
    for layout, row in zip(layouts, sel):
        for p, m in _masks(layout, row.cpu()).values():
            if m.any():
                masks[p] = m.to(p.device)
    restriction = HeadRestriction(masks, previous={p: p.requires_grad for p in model.parameters()})
    for p in model.parameters():
        p.requires_grad_(p in masks)
    for p, m in masks.items():
        restriction.handles.append(p.register_hook(lambda g, m=m: g * m))
    return restriction


def attention_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every weight and bias of the attention projections (q/k/v/o), each once."""
    seen: dict[int, nn.Parameter] = {}
    for layout in find_attention(model):
        for mod in (layout.q, layout.k, layout.v, layout.o):
            for p in mod.parameters(recurse=False):
                seen.setdefault(id(p), p)
    return list(seen.values())


# --------------------------------------------------------------------------------------------------
# save / load


@dataclass
class HeadSelection:
    """A head mask ``(L, H)`` with the scores it came from and how (score kind, fraction, source)."""

    mask: torch.Tensor
    scores: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def heads(self) -> list[tuple[int, int, float]]:
        """Selected ``(layer, head, score)``, best first (ties by index)."""
        idx = [(int(l), int(h)) for l, h in self.mask.nonzero().tolist()]
        return sorted(((l, h, float(self.scores[l, h])) for l, h in idx), key=lambda t: (-t[2], t[0], t[1]))

    def __iter__(self) -> Iterator[tuple[int, int, float]]:
        return iter(self.heads)


def save_heads(path: str | Path, selection: HeadSelection) -> Path:
    """Write the mask (uint8) and scores (float64) to one safetensors file, atomically (``core.io``)."""
    from rankwise.core.io import save_tensors

    if selection.mask.shape != selection.scores.shape:
        raise ValueError(f"mask {tuple(selection.mask.shape)} and scores {tuple(selection.scores.shape)} differ")
    meta = {"kind": "rankwise.p2d.heads", **selection.meta}
    return save_tensors(path, {"mask": selection.mask.to(torch.uint8), "scores": selection.scores.double()}, meta)


def load_heads(path: str | Path, num_layers: int | None = None, num_heads: int | None = None) -> HeadSelection:
    """Read a file of :func:`save_heads`; checks its kind and, when given, the model's ``(L, H)``."""
    from rankwise.core.io import load_tensors

    tensors, meta = load_tensors(path, {"mask": (None, torch.uint8), "scores": (None, torch.float64)})
    if meta.get("kind") != "rankwise.p2d.heads":
        raise ArtifactError(f"{path}: not a rankwise P2D head mask (kind {meta.get('kind')!r})")
    mask, scores = tensors["mask"].bool(), tensors["scores"]
    if mask.dim() != 2 or mask.shape != scores.shape:
        raise ArtifactError(f"{path}: mask {tuple(mask.shape)} and scores {tuple(scores.shape)} must be one (L, H) shape")
    want = (num_layers, num_heads)
    if any(w is not None and w != g for w, g in zip(want, mask.shape)):
        raise ArtifactError(f"{path}: head mask is {tuple(mask.shape)}, the model has {want}")
    meta = {k: v for k, v in meta.items() if k != "kind"}
    return HeadSelection(mask, scores, meta)
