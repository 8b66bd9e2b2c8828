"""STAR-KV: learned soft thresholds choose per-head K ranks and per-layer V ranks for a low-rank KV cache.

"STAR-KV" (ICML 2026, arXiv 2606.08382; official code github.com/PriyanshBhatnagar/STAR-KV). Spec:
``shared/methods/star_kv.md``; this page: ``docs/methods/star_kv.md``.

Per attention layer the key projection is decomposed per KV head (``W_K^h = U_h diag(s_h) V_h``) and the
value projection jointly (``W_V = U diag(s) V``); the cache stores the latents ``V_h x`` (``r_h`` numbers per
head) and ``V x`` (``r_V``). A trainable threshold ``alpha`` per K head and per V layer cuts the spectrum
through the soft threshold ``f(s) = s tanh(s0 (s - alpha))`` (``s > alpha``, else 0) with a custom backward,
trained by distillation from the uncompressed model plus ``lambda sum exp(-alpha)``; phase 1 stops each
threshold family at its target, phase 2 distils with thresholds frozen, phase 3 folds ``(s - alpha)_+`` into
``V`` and distils the fused factors. Latents can be quantised after a block Hadamard rotation (4 bits for
the leading 20 % of each head's latent, 3 bits for the rest).

Public face: :class:`StarKVConfig`, :func:`star_kv_compress` (all phases), the steps :func:`star_kv_wrap`,
:func:`star_kv_train`, :func:`star_kv_freeze`, :func:`kd_finetune`; the layers; the latent-cache attention
(:func:`latent_attention`, :class:`LatentKVCache`); the quantiser (:func:`mixed_precision_quantize`, ...);
the fixed-rank baselines (:func:`lowrank_kv` with :func:`uniform_plan` / :func:`energy_plan`); kvpress rows
(:func:`press_continuation_nll`); :func:`save_star_kv` / :func:`load_star_kv`.
"""

from rankwise.compress.star_kv.config import StarKVConfig
from rankwise.compress.star_kv.latent import LatentKVCache, latent_attention
from rankwise.compress.star_kv.layers import LatentProj, ThresholdedProj, group_svd
from rankwise.compress.star_kv.model import (
    AttentionSite,
    StarKVReport,
    TrainLog,
    attention_sites,
    energy_plan,
    kd_finetune,
    kd_loss,
    kv_accounting,
    lowrank_kv,
    rank_table,
    spectra,
    star_kv_compress,
    star_kv_freeze,
    star_kv_train,
    star_kv_wrap,
    uniform_plan,
)
from rankwise.compress.star_kv.presses import PRESSES, continuation_nll, make_press, press_continuation_nll
from rankwise.compress.star_kv.quant import (
    block_hadamard,
    dequantize,
    mixed_precision_quantize,
    quantize,
    random_hadamard_rotation,
    relative_mse,
    uniform_quantize,
)
from rankwise.compress.star_kv.serialization import load_star_kv, save_star_kv
from rankwise.compress.star_kv.threshold import SoftThreshold, soft_threshold, soft_threshold_reference, threshold_rank
from rankwise.core.registry import register

__all__ = [
    "StarKVConfig", "star_kv_compress", "star_kv_wrap", "star_kv_train", "star_kv_freeze", "kd_finetune",
    "kd_loss", "StarKVReport", "TrainLog", "AttentionSite", "attention_sites", "kv_accounting", "rank_table",
    "spectra", "uniform_plan", "energy_plan", "lowrank_kv", "ThresholdedProj", "LatentProj", "group_svd",
    "SoftThreshold", "soft_threshold", "soft_threshold_reference", "threshold_rank", "latent_attention",
    "LatentKVCache", "quantize", "dequantize", "uniform_quantize", "mixed_precision_quantize", "block_hadamard",
    "random_hadamard_rotation", "relative_mse", "PRESSES", "make_press", "press_continuation_nll",
    "continuation_nll", "save_star_kv", "load_star_kv",
]

register("star_kv", config=StarKVConfig, entry=star_kv_compress, module=__name__)
