"""SANTA's configuration: which estimator, how many value rows, tiling, seeding, prefill fallback."""

from __future__ import annotations

from dataclasses import dataclass

from rankwise.core.validate import check_bool, check_choice, check_int, check_positive

#: value-stage estimators (spec §1-§3): i.i.d. multinomial, stratified and systematic inverse-CDF sampling
SCHEMES: tuple[str, ...] = ("iid", "stratified", "systematic")
#: per-tile sample budgets of the tiled variant (spec §4): S/T per tile, or proportional to the tile mass
BUDGETS: tuple[str, ...] = ("fixed", "proportional")
#: schemes a patched model accepts: the estimators and the biased top-k baseline (the S largest p_i, renormalised)
MODEL_SCHEMES: tuple[str, ...] = SCHEMES + ("topk",)


@dataclass(frozen=True)
class SantaConfig:
    """How :func:`~rankwise.infer.santa.santa_decode` estimates ``o = softmax(q K^T / sqrt(d)) V``.

    * ``num_samples``: S, the value rows drawn per head and decode step (the paper: S = 2048 at 32k
      context, S = 64 in our tiny-model test). S > n is allowed; reads are clamped to n rows.
    * ``scheme``: ``"systematic"`` (S²ANTA, the paper's GPU variant; default), ``"stratified"`` or
      ``"iid"`` (plain SANTA); ``"topk"`` is the deterministic top-k baseline (k = num_samples), for
      comparisons in a patched model.
    * ``tile_size``: None (one tile, the untiled estimator) or the rows per tile of the tiled variant
      (the official kernels use 256); ``budget``: ``"fixed"`` (ceil(S/T) per tile) or ``"proportional"``
      (largest-remainder rounding of S * P_t, at least 1 for every tile with mass).
    * ``decode_only``: in a patched model, calls with more than one query position (prefill) use exact
      SDPA; False runs the estimator for every query position under the causal mask.
    * ``seed``: base seed; every (decode step, layer, head, tile) gets its own hashed stream.
    * ``ternary_query``: replace q by the Bernoulli ternary query (spec §5) before the scores;
      ``tau``: its scale (None: the per-vector max |q_j|, a choice; the paper gives no rule).
    """

    num_samples: int = 64
    scheme: str = "systematic"
    tile_size: int | None = None
    budget: str = "fixed"
    decode_only: bool = True
    seed: int = 0
    ternary_query: bool = False
    tau: float | None = None

    def __post_init__(self) -> None:
        check_int("SantaConfig.num_samples", self.num_samples, 1)
        check_choice("SantaConfig.scheme", self.scheme, MODEL_SCHEMES)
        check_int("SantaConfig.tile_size", self.tile_size, 1, allow_none=True)
        check_choice("SantaConfig.budget", self.budget, BUDGETS)
        check_bool("SantaConfig.decode_only", self.decode_only)
        check_int("SantaConfig.seed", self.seed, 0)
        check_bool("SantaConfig.ternary_query", self.ternary_query)
        check_positive("SantaConfig.tau", self.tau, allow_none=True)
