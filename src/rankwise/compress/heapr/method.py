"""HEAPr scores (Sec. 3.3, Eq. 15-16, Alg. 1), the ablation scores, atom selection and in-place pruning.

Calibration is ONE forward + backward pass per batch through :class:`rankwise.core.stats.StatsCollector`
with kind ``"kfac"`` on every routed expert's ``down_proj`` (``mask=None``: an expert's ``down_proj``
sees only its routed tokens, so the batch's token mask does not apply). For expert ``i`` of a layer,
over the tokens ``T_i`` routed to it:

* ``gtg / n_grad_tokens = G_i = mean_t g g^T`` (``H x H``) with ``g = dl/dE_i``, the gradient of the
  loss w.r.t. the expert's own output, before the router weight (:class:`UnfusedExperts` applies the
  router weight outside the expert);
* ``diag(kfac_xtx) = sum_t a_t^2`` (``I``), the diagonal of the K-FAC input factor;
* ``n_grad_tokens = |T_i|``.

Then ``s_ij = 1/2 (sum_t a_tj^2 / |T_i|) u_j^T G_i u_j`` with ``u_j = W_down[:, j]`` (Eq. 16).
The official code's second forward-only pass for ``sum a^2`` is not needed: the same backward pass
already holds the activations. The per-token variant and the first-order Taylor ablation need
``c_tj = a_tj g_t . u_j`` per token; a second hook on the same ``down_proj`` accumulates
``sum_t c_tj^2`` and ``sum_t c_tj`` in the same backward. Experts that received no calibration token
score ``-1`` (pruned first, as in the official code).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from rankwise.compress.heapr.config import HEAPrConfig
from rankwise.compress.heapr.experts import moe_layers, unfuse_experts
from rankwise.core.stats import CalibrationError, StatsCollector
from rankwise.core.surgery import count_parameters

log = logging.getLogger(__name__)

__all__ = ["ExpertStats", "HEAPrReport", "calibrate", "atom_scores", "heapr_scores", "select_atoms",
           "prune_atoms", "heapr_prune", "heapr_compress", "drop_experts", "expert_frequency", "lm_forward",
           "UNROUTED"]

UNROUTED = -1.0  #: the score of every atom of an expert that saw no calibration token


@dataclass
class ExpertStats:
    """Calibration statistics of one routed expert (float64 sums over its routed tokens ``T_i``)."""

    count: int                       #: |T_i|
    gtg: torch.Tensor | None         #: (H, H) sum_t g g^T  (None when count == 0)
    a2: torch.Tensor | None          #: (I,) sum_t a_j^2
    c2: torch.Tensor | None          #: (I,) sum_t (a_j g . u_j)^2
    c1: torch.Tensor | None          #: (I,) sum_t a_j g . u_j

    def G(self) -> torch.Tensor:
        """``G_i = mean_{T_i} g g^T`` (``H x H``, symmetric PSD)."""
        if self.gtg is None or self.count == 0:
            raise CalibrationError("this expert received no calibration token")
        return self.gtg / self.count


def lm_forward(model: nn.Module, batch: Any) -> Any:
    """Call a causal LM on a batch with next-token labels: a tensor of ids, or a dict with ``input_ids``
    (``labels`` default to the ids, with padding, where ``attention_mask`` is 0, set to -100)."""
    if isinstance(batch, torch.Tensor):
        return model(input_ids=batch, labels=batch)
    if isinstance(batch, Mapping):
        kw = dict(batch)
        if "labels" not in kw:
            labels = kw["input_ids"].clone()
            if isinstance(kw.get("attention_mask"), torch.Tensor):
                labels[kw["attention_mask"] == 0] = -100
            kw["labels"] = labels
        return model(**kw)
    raise TypeError(f"a calibration batch must be a tensor of token ids or a dict, got {type(batch).__name__}")


class _TokenTerms:
    """Per-token ``c_tj = a_tj (g_t . u_j)`` sums of each ``down_proj`` (``sum c^2``, ``sum c``)."""

    def __init__(self, modules: dict[str, nn.Linear]):
        self.modules = modules
        self.c2: dict[str, torch.Tensor] = {}
        self.c1: dict[str, torch.Tensor] = {}
        self.handles: list[Any] = []

    def attach(self) -> None:
        for name, mod in self.modules.items():
            self.handles.append(mod.register_forward_hook(self._hook(name)))

    def detach(self) -> None:
        while self.handles:
            self.handles.pop().remove()

    def _hook(self, name: str) -> Callable:
        def hook(module: nn.Linear, args: tuple, out: torch.Tensor) -> None:
            if not (torch.is_grad_enabled() and out.requires_grad):
                return
            a = args[0].detach()

            def grad_hook(g: torch.Tensor) -> None:
                W = module.weight.detach().to(torch.float64)
                c = a.reshape(-1, a.shape[-1]).to(torch.float64) * (g.reshape(-1, g.shape[-1]).to(torch.float64) @ W)
                for store, v in ((self.c2, c.square().sum(0)), (self.c1, c.sum(0))):
                    store[name] = store[name] + v if name in store else v
            out.register_hook(grad_hook)
        return hook


def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    progress: bool = False,
) -> dict[str, list[ExpertStats]]:
    """One forward + backward per batch; returns ``{MoE layer name: [ExpertStats per expert]}``.

    Unfuses the experts first (exact) if needed. ``forward(model, batch)`` defaults to
    :func:`lm_forward` (the mean next-token cross-entropy with labels = inputs); ``loss_fn(output,
    batch)`` defaults to ``output.loss``. The model runs in eval mode (the tiny models have no dropout;
    Mixtral's router jitter is off) and its parameters' ``.grad`` are not touched.
    """
    layers = moe_layers(model)
    if not layers:
        unfuse_experts(model)  # exact; raises TypeError for a model without MoE blocks
        layers = moe_layers(model)
    targets = {f"{ln}.experts.{e}.down_proj": ex.down_proj
               for ln, m in layers.items() for e, ex in enumerate(m.experts) if ex.width > 0}
    if not targets:
        raise CalibrationError("every routed expert has width 0: nothing to score")
    col = StatsCollector(model, list(targets), kinds=("kfac",), types=(nn.Linear,))
    terms = _TokenTerms(targets)
    flags = {m: m.training for m in model.modules()}
    model.eval()
    n_batches = 0
    it: Iterable[Any] = batches
    if progress:
        from rich.progress import track
        it = track(batches, description="HEAPr calibration")
    try:
        with col:
            terms.attach()  # after the collector: its hook makes the outputs require grad
            for batch in it:
                col.run(batch, forward=forward or lm_forward, loss_fn=loss_fn, mask=None)
                n_batches += 1
    finally:
        terms.detach()
        for m, f in flags.items():
            m.training = f
    if n_batches == 0:
        raise CalibrationError("the calibration data is empty: `batches` yielded no batch")
    stats = col.results(check=False)  # unrouted experts keep count 0 and score -1
    for st in stats.values():
        st.check_finite()
    out: dict[str, list[ExpertStats]] = {}
    for ln, m in layers.items():
        row = []
        for e, ex in enumerate(m.experts):
            name = f"{ln}.experts.{e}.down_proj"
            st = stats.get(name)
            if st is None or st.n_grad_tokens == 0:
                row.append(ExpertStats(0, None, None, None, None))
                continue
            row.append(ExpertStats(st.n_grad_tokens, st.gtg, torch.diagonal(st.kfac_xtx).clone(),
                                   terms.c2[name], terms.c1[name]))
        out[ln] = row
    return out


def atom_scores(model: nn.Module, stats: Mapping[str, list[ExpertStats]], config: HEAPrConfig | None = None
                ) -> dict[str, list[torch.Tensor]]:
    """Atom scores ``{layer: [tensor (width_e,) per expert]}`` (float64) from :func:`calibrate`'s statistics.

    ``config.score``: ``"heapr"`` (Eq. 16, or the per-token variant with ``fisher="per_token"``),
    ``"energy"`` (``mean_t a^2 ||u||^2``), ``"taylor"`` (``|mean_t a g . u|``), ``"random"`` (uniform
    in ``[0, 1)`` from ``config.seed``). Unrouted experts score :data:`UNROUTED` except for ``"random"``.
    """
    cfg = config or HEAPrConfig()
    layers = moe_layers(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    out: dict[str, list[torch.Tensor]] = {}
    for ln, m in layers.items():
        if ln not in stats:
            raise KeyError(f"no statistics for MoE layer {ln!r}")
        row = []
        for e, ex in enumerate(m.experts):
            st = stats[ln][e]
            W = ex.down_proj.weight.detach().to("cpu", torch.float64)  # (H, I)
            width = W.shape[1]
            if cfg.score == "random":
                row.append(torch.rand(width, generator=gen, dtype=torch.float64))
                continue
            if st.count == 0 or width == 0:
                row.append(torch.full((width,), UNROUTED, dtype=torch.float64))
                continue
            if st.a2 is None or st.a2.shape[0] != width:
                raise ValueError(f"{ln} expert {e}: statistics of width {None if st.a2 is None else st.a2.shape[0]} "
                                 f"do not fit the expert's width {width} (recalibrate after pruning)")
            mean_a2 = st.a2.cpu() / st.count
            if cfg.score == "energy":
                s = mean_a2 * W.square().sum(0)
            elif cfg.score == "taylor":
                s = (st.c1.cpu() / st.count).abs()
            elif cfg.fisher == "per_token":
                s = 0.5 * st.c2.cpu() / st.count
            else:
                G = st.gtg.cpu() / st.count
                s = 0.5 * mean_a2 * ((G @ W) * W).sum(0)          # 1/2 mean a^2 u^T G u  (Eq. 16)
            row.append(s)
        out[ln] = row
    return out


def heapr_scores(model: nn.Module, calib: Iterable[Any], config: HEAPrConfig | None = None, **kw: Any
                 ) -> dict[str, list[torch.Tensor]]:
    """Calibrate (:func:`calibrate`, keyword arguments passed on) and score (:func:`atom_scores`)."""
    return atom_scores(model, calibrate(model, calib, **kw), config)


def select_atoms(scores: Mapping[str, list[torch.Tensor]], config: HEAPrConfig) -> dict[str, list[torch.Tensor]]:
    """The kept atom indices ``{layer: [sorted long tensor per expert]}``: the top ``int(N (1 - p))``
    scores over all layers (``scope="global"``) or within each layer (``"layer"``). Ties are broken by
    position (earlier layer, expert and atom first), deterministically."""
    groups = [list(scores)] if config.scope == "global" else [[ln] for ln in scores]
    keep: dict[str, list[torch.Tensor]] = {ln: [] for ln in scores}
    for group in groups:
        flat = [(ln, e, s) for ln in group for e, s in enumerate(scores[ln])]
        allv = torch.cat([s.to(torch.float64).reshape(-1) for _, _, s in flat]) if flat else torch.zeros(0)
        if not bool(torch.isfinite(allv).all()):
            raise ValueError("atom scores contain NaN or Inf")
        n = allv.numel()
        k = int(n * (1.0 - config.prune_ratio))
        order = torch.sort(-allv, stable=True).indices[:k]
        mask = torch.zeros(n, dtype=torch.bool)
        mask[order] = True
        pos = 0
        for ln, e, s in flat:
            w = s.numel()
            keep[ln].append(torch.nonzero(mask[pos:pos + w]).reshape(-1))
            pos += w
    return keep


@dataclass
class HEAPrReport:
    """What :func:`prune_atoms` did."""

    widths_before: dict[str, list[int]]
    kept_per_expert: dict[str, list[int]]
    params_before: int
    params_after: int
    expert_params_before: int
    expert_params_after: int
    config: dict[str, Any] = field(default_factory=dict)
    tokens_per_expert: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def atoms_before(self) -> int:
        return sum(sum(v) for v in self.widths_before.values())

    @property
    def atoms_after(self) -> int:
        return sum(sum(v) for v in self.kept_per_expert.values())

    def rows(self) -> list[dict[str, Any]]:
        """One row per expert: layer, expert, width before/after, calibration tokens."""
        return [{"layer": ln, "expert": e, "before": b, "after": a,
                 "tokens": (self.tokens_per_expert.get(ln) or [None] * len(bs))[e]}
                for ln, bs in self.widths_before.items()
                for e, (b, a) in enumerate(zip(bs, self.kept_per_expert[ln]))]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(atoms_before=self.atoms_before, atoms_after=self.atoms_after)
        return d


def prune_atoms(model: nn.Module, keep: Mapping[str, list[torch.Tensor]]) -> HEAPrReport:
    """Keep only the atoms ``keep[layer][expert]`` (sorted indices) of each routed expert, in place.

    Slices the rows of ``gate_proj``/``up_proj`` and the columns of ``down_proj`` (``3 H`` parameters
    per removed atom of a gated expert); no weight compensation. An expert whose atoms are all kept is
    left untouched (so ``p = 0`` is bit-identical); one with none kept becomes a width-0 MLP that
    outputs zeros (a warning says which). Everything is checked before any module changes.
    """
    layers = moe_layers(model)
    if set(keep) != set(layers):
        raise ValueError(f"keep names layers {sorted(keep)}, the model's MoE layers are {sorted(layers)}")
    for ln, m in layers.items():
        if len(keep[ln]) != m.num_experts:
            raise ValueError(f"{ln}: {len(keep[ln])} index tensors for {m.num_experts} experts")
        for e, (idx, ex) in enumerate(zip(keep[ln], m.experts)):
            idx = torch.as_tensor(idx)
            if idx.ndim != 1 or (idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= ex.width)) \
                    or (idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all())):
                raise ValueError(f"{ln} expert {e}: kept indices must be sorted, unique, in [0, {ex.width})")
    before_total = count_parameters(model)
    before_exp = sum(p.numel() for m in layers.values() for p in m.parameters())
    widths_before = {ln: m.widths for ln, m in layers.items()}
    zero: list[str] = []
    for ln, m in layers.items():
        for e, (idx, ex) in enumerate(zip(keep[ln], m.experts)):
            idx = torch.as_tensor(idx, dtype=torch.long)
            if idx.numel() == ex.width:
                continue
            ex.keep(idx)
            if idx.numel() == 0:
                zero.append(f"{ln}[{e}]")
    if zero:
        warnings.warn(f"{len(zero)} expert(s) pruned to width 0 (they now output zeros): {', '.join(zero[:8])}"
                      + (" ..." if len(zero) > 8 else ""), stacklevel=2)
    return HEAPrReport(widths_before=widths_before, kept_per_expert={ln: m.widths for ln, m in layers.items()},
                       params_before=before_total, params_after=count_parameters(model),
                       expert_params_before=before_exp,
                       expert_params_after=sum(p.numel() for m in layers.values() for p in m.parameters()))


def heapr_prune(model: nn.Module, scores: Mapping[str, list[torch.Tensor]], config: HEAPrConfig) -> HEAPrReport:
    """Select (:func:`select_atoms`) and prune (:func:`prune_atoms`) in place."""
    rep = prune_atoms(model, select_atoms(scores, config))
    rep.config = dataclasses.asdict(config)
    return rep


def heapr_compress(model: nn.Module, config: HEAPrConfig | None = None, *, calib: Iterable[Any],
                   forward: Callable | None = None, loss_fn: Callable | None = None,
                   progress: bool = False) -> HEAPrReport:
    """The whole method in place: unfuse (exact), calibrate, score, select, slice. Returns the report."""
    cfg = config or HEAPrConfig()
    t0 = time.perf_counter()
    stats = calibrate(model, calib, forward=forward, loss_fn=loss_fn, progress=progress)
    rep = heapr_prune(model, atom_scores(model, stats, cfg), cfg)
    rep.tokens_per_expert = {ln: [s.count for s in row] for ln, row in stats.items()}
    rep.seconds = time.perf_counter() - t0
    return rep


def expert_frequency(stats: Mapping[str, list[ExpertStats]]) -> dict[str, list[int]]:
    """Calibration tokens routed to each expert (``|T_i|``)."""
    return {ln: [s.count for s in row] for ln, row in stats.items()}


def drop_experts(model: nn.Module, frequency: Mapping[str, list[int]], n_drop: int) -> HEAPrReport:
    """Frequency-based expert dropping (the baseline): in every MoE layer, remove (width 0) the
    ``n_drop`` experts that received the fewest calibration tokens (ties: the lower index is dropped)."""
    layers = moe_layers(model)
    keep: dict[str, list[torch.Tensor]] = {}
    for ln, m in layers.items():
        if not 0 <= n_drop <= m.num_experts:
            raise ValueError(f"n_drop must be in [0, {m.num_experts}], got {n_drop}")
        freq = torch.tensor(frequency[ln], dtype=torch.float64)
        dropped = set(torch.sort(freq, stable=True).indices[:n_drop].tolist())
        keep[ln] = [torch.arange(0) if e in dropped else torch.arange(ex.width) for e, ex in enumerate(m.experts)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # width-0 experts are the point here
        return prune_atoms(model, keep)
