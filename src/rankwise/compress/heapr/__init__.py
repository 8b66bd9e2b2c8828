"""HEAPr: pruning MoE atomic experts with an output-space OBS score.

HEAPr, ICLR 2026 (arXiv 2509.22299; official code github.com/LLIKKE/HEAPr). Spec: ``shared/methods/heapr.md``; docs: ``docs/methods/heapr.md``.

An atomic expert (atom) ``(i, j)`` is neuron ``j`` of routed expert ``i``: row ``j`` of ``W_gate`` and
``W_up`` and column ``u_j`` of ``W_down``, with output ``e_ij(x) = u_j a_ij(x)``. Its score (Eq. 16)::

    s_ij = 1/2 [mean_{T_i} a_ij^2] u_j^T G_i u_j,     G_i = mean_{T_i} g g^T,  g = dl/dE_i(x)

over the calibration tokens ``T_i`` routed to expert ``i``. One backward pass gives everything
(:func:`calibrate`); the lowest-scoring atoms are sliced away, globally or per layer.

Use::

    from rankwise.compress.heapr import HEAPrConfig, heapr_compress, save_pruned, load_pruned
    report = heapr_compress(model, HEAPrConfig(prune_ratio=0.25), calib=batches)   # in place
    save_pruned(model, "out/", tokenizer=tok, report=report)
    model2 = load_pruned("out/")

or step by step: :func:`unfuse_experts` (exact), :func:`heapr_scores` / :func:`atom_scores`,
:func:`heapr_prune` (:func:`select_atoms` + :func:`prune_atoms`). Baselines: :func:`drop_experts`
(frequency-based expert dropping) and the ablation scores ``energy`` (CAMERA-like), ``taylor``,
``random`` of :class:`HEAPrConfig`.
"""

from rankwise.compress.heapr.config import FISHERS, SCOPES, SCORES, HEAPrConfig
from rankwise.compress.heapr.experts import (
    SUPPORTED,
    ExpertMLP,
    UnfusedExperts,
    find_fused_experts,
    moe_layers,
    unfuse_experts,
)
from rankwise.compress.heapr.method import (
    UNROUTED,
    ExpertStats,
    HEAPrReport,
    atom_scores,
    calibrate,
    drop_experts,
    expert_frequency,
    heapr_compress,
    heapr_prune,
    heapr_scores,
    lm_forward,
    prune_atoms,
    select_atoms,
)
from rankwise.compress.heapr.serialization import is_pruned_dir, load_pruned, save_pruned
from rankwise.core.registry import register

__all__ = [
    "HEAPrConfig", "SCOPES", "FISHERS", "SCORES", "SUPPORTED", "ExpertMLP", "UnfusedExperts", "find_fused_experts",
    "moe_layers", "unfuse_experts", "UNROUTED", "ExpertStats", "HEAPrReport", "atom_scores", "calibrate",
    "drop_experts", "expert_frequency", "heapr_compress", "heapr_prune", "heapr_scores", "lm_forward",
    "prune_atoms", "select_atoms", "is_pruned_dir", "load_pruned", "save_pruned",
]

register("heapr", config=HEAPrConfig, entry=heapr_compress, module=__name__)
