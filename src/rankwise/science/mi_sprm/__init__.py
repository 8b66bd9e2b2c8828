"""MI-SPRM+: parameter-free smooth predictive Regret Matching+ with an Adaptive Regret Domain.

Spec: ``shared/methods/mi_sprm.md`` ("A Faster Parameter-Free Regret Matching Algorithm", ICLR 2026).

- :mod:`.regret`: the local regret minimisers (RM, RM+, PRM+, SPRM+, SEG-RM+, MI-SPRM+) as batched,
  stateful objects with ``next_strategy()`` / ``observe_loss(loss)``, plus the projection onto the
  regret domain ``D_B = {R >= 0, ||R||_1 >= B}``;
- :mod:`.matrix`: self-play on normal-form zero-sum games (:func:`solve_matrix_game`, duality gap);
- :mod:`.games`: native Kuhn and Leduc poker, and an adapter for any OpenSpiel two-player game;
- :mod:`.efg`: CFR in sequence form with any local minimiser (:class:`CFRSolver`), exact
  exploitability, and OpenSpiel cross-checks.

Example::

    import numpy as np
    from rankwise.science.mi_sprm import MISPRMPlus, solve_matrix_game, CFRSolver, KuhnPoker
    A = np.random.default_rng(0).uniform(-1, 1, (10, 10))
    res = solve_matrix_game(A, MISPRMPlus(), iters=10_000)
    print(res.gap, res.slope())
    print(CFRSolver(KuhnPoker(), local=MISPRMPlus()).run(1000).exploitability[-1])
"""

from rankwise.core.registry import register
from rankwise.science.mi_sprm.efg import (
    CFRResult,
    CFRSolver,
    SequenceForm,
    Treeplex,
    build_sequence_form,
    openspiel_cfr_curve,
    openspiel_exploitability,
)
from rankwise.science.mi_sprm.games import CHANCE, KuhnPoker, LeducPoker, OpenSpielGame, replay
from rankwise.science.mi_sprm.matrix import (
    MatrixGameResult,
    as_payoff_matrix,
    duality_gap,
    fit_loglog_slope,
    log_schedule,
    solve_matrix_game,
)
from rankwise.science.mi_sprm.regret import (
    RM,
    MISPRMPlus,
    PRMPlus,
    RegretAlgorithm,
    RegretMinimizer,
    RMPlus,
    SEGRMPlus,
    SPRMPlus,
    instant_regret,
    normalize,
    project_regret_domain,
    project_scaled_simplex,
)

__all__ = [
    "RM", "RMPlus", "PRMPlus", "SPRMPlus", "SEGRMPlus", "MISPRMPlus", "RegretAlgorithm", "RegretMinimizer",
    "normalize", "project_regret_domain", "project_scaled_simplex", "instant_regret",
    "solve_matrix_game", "duality_gap", "MatrixGameResult", "fit_loglog_slope", "log_schedule", "as_payoff_matrix",
    "KuhnPoker", "LeducPoker", "OpenSpielGame", "CHANCE", "replay",
    "CFRSolver", "CFRResult", "SequenceForm", "Treeplex", "build_sequence_form",
    "openspiel_exploitability", "openspiel_cfr_curve",
]

register("mi_sprm", config=MISPRMPlus, entry=solve_matrix_game, solvers={"cfr": CFRSolver})
