"""PSOFT: orthogonal fine-tuning confined to the principal subspace of each weight (ICLR 2026, arXiv 2505.11235).

For a frozen weight ``W0 (d_out, d_in)`` with truncated SVD ``W0 ≈ U_r S_r V_r^T`` (top ``r``), PSOFT
freezes the principal factors ``B (d_out, r)`` and ``A (r, d_in)`` (``B A = U_r S_r V_r^T``) and the
residual ``W_res = W0 - B A``, and trains a small ``r x r`` transform between them::

    W = W_res + B M A,       M = diag(beta) R diag(alpha),      R = Cayley(Q) = (I - Q)(I + Q)^{-1}

``Q`` is skew-symmetric, stored as its ``r (r - 1) / 2`` free entries ``q`` (init 0); ``alpha``
(input side) and ``beta`` (output side) are relaxation vectors (init 1). The Cayley map is computed
exactly (``torch.linalg.solve``) or with ``t`` Neumann terms for ``(I + Q)^{-1}``::

    R_t = I + 2 sum_{k=1..t} (-Q)^k + (-Q)^{t+1}          (t = 0 gives I - Q)

The series converges only for ``||Q|| < 1``; rankwise warns once per adapter when the spectral norm
of ``Q`` passes 0.9, and ``neumann_eps`` (PEFT's ``cayley_neumann_eps``) optionally rescales ``Q`` to a
Frobenius norm below 1 first. Trainable: ``r (r - 1)/2 + 2 r`` parameters per matrix, independent of
``d_in``, ``d_out``.

Geometry. With ``alpha = beta = 1`` and exact Cayley, ``M`` is orthogonal. Where the singular values
go decides what it preserves (``singular_values_on``):

* ``"output"`` (default; the PSOFT authors' reading, as in PEFT's ``psoft_init``): ``B = U_r S_r``,
  ``A = V_r^T`` with orthonormal rows ("orthogonality constraint on the down-projection"). Then
  ``(M A)(M A)^T = I`` and the principal part keeps its row Gram matrix ``B B^T``: the pairwise
  angles and norms of the neurons' weight vectors (rows of ``W``, columns of the paper's ``W``).
* ``"input"``: ``B = U_r``, ``A = S_r V_r^T``; then ``(B M)^T (B M) = I`` and the column Gram
  matrix ``A^T A`` of the principal part is kept.

Implementation. rankwise keeps ``W0`` untouched and computes the same function as
``W0 x + B (M - I) A x`` (``M = I`` at initialisation, so the output is exactly the pretrained one),
which is how PEFT's PSOFT computes it too; merging adds ``B (M - I) A`` to ``W0``. With
``orth=False`` ``M`` is a free ``r x r`` matrix (init ``I``) and, without the vectors, PSOFT is
LoRA-XS with a residual. The skew entries ``q`` are ordered as PEFT's ``OrthLayer.weight`` (upper
triangle, row-major, transposed into the lower triangle), so that with ``singular_values_on="output"``
the same ``q, alpha, beta`` give the same ``R`` and the same update as PEFT's PSOFT (whose
``num_cayley_neumann_terms = t + 2`` for ``t >= 3``; PEFT's default is the exact solve).

Usage::

    from rankwise.adapt.psoft import PSOFTConfig, adapt, merge, orthogonality_report
    adapt(model, PSOFTConfig(r=38))      # SVD per layer; q, alpha, beta trainable
    ...train...
    orthogonality_report(model)          # ||M^T M - I||_F per layer (drift from orthogonality)
    check_neumann(model)                 # warn if the Neumann series is inaccurate (also on model.eval())
    merge(model)
"""

from __future__ import annotations

from rankwise.adapt.psoft.config import (  # noqa: F401
    CAYLEY,
    CONFIG_FILE,
    NEUMANN_WARN_NORM,
    num_parameters,
    PSOFTConfig,
    rank_for_budget,
    RANK_RTOL,
    SIDES,
    WEIGHTS_FILE,
)
from rankwise.adapt.psoft.functional import (  # noqa: F401
    cayley,
    NumericalError,
    principal_factors,
    skew_from_params,
)
from rankwise.adapt.psoft.layer import (  # noqa: F401
    AdapterLayer,
    PSOFTLinear,
    RankwiseError,
    validate_adapter_name,
)
from rankwise.adapt.psoft.model import (  # noqa: F401
    adapt,
    adapter_names,
    apply_psoft,
    check_neumann,
    delete_adapter,
    disable_adapters,
    enable_adapters,
    load_adapter,
    merge,
    orthogonality_report,
    PSOFT,
    psoft_layers,
    register,
    replace_module,
    save_adapter,
    Selector,
    set_active,
    unload,
    unmerge,
)

__all__ = [
    "PSOFTConfig",
    "PSOFTLinear",
    "adapt",
    "adapter_names",
    "apply_psoft",
    "cayley",
    "check_neumann",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "load_adapter",
    "merge",
    "num_parameters",
    "orthogonality_report",
    "principal_factors",
    "psoft_layers",
    "rank_for_budget",
    "save_adapter",
    "set_active",
    "skew_from_params",
    "unload",
    "unmerge",
]
