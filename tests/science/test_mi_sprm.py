"""Correctness checks and bad inputs of MI-SPRM+ and its baselines (spec shared/methods/mi_sprm.md)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rankwise.core.errors import NumericalError
from rankwise.science.mi_sprm import (
    RM,
    CFRSolver,
    KuhnPoker,
    LeducPoker,
    MISPRMPlus,
    PRMPlus,
    RMPlus,
    SEGRMPlus,
    SPRMPlus,
    build_sequence_form,
    duality_gap,
    normalize,
    project_regret_domain,
    solve_matrix_game,
)

ALL = [RM(), RMPlus(), PRMPlus(), SPRMPlus(eta=0.05), SEGRMPlus(eta=0.05), MISPRMPlus(), MISPRMPlus(ard="norm")]
RPS = np.array([[0.0, 1.0, -1.0], [-1.0, 0.0, 1.0], [1.0, -1.0, 0.0]])


def _selfplay_strategies(algo, A, iters):
    """Yield (x_t, y_t) of simultaneous self-play, driving the minimisers directly."""
    X, Y = algo.make(A.shape[0]), algo.make(A.shape[1])
    for _ in range(iters):
        x, y = X.next_strategy(), Y.next_strategy()
        yield x, y
        X.observe_loss(A @ y)
        Y.observe_loss(-A.T @ x)


# ------------------------------------------------------------------------------------ projection


def _brute_projection(y, B):
    """Exact projection onto {R >= 0, sum R >= B} by enumerating supports (small d only)."""
    d = y.size
    cands = [np.maximum(y, 0.0)] if np.maximum(y, 0.0).sum() >= B else []
    for k in range(1, d + 1):
        for S in itertools.combinations(range(d), k):
            S = list(S)
            mu = (B - y[S].sum()) / k
            w = np.zeros(d)
            w[S] = y[S] + mu
            if np.all(w >= -1e-15) and w.sum() >= B - 1e-12:
                cands.append(np.maximum(w, 0.0))
    feas = [c for c in cands if c.sum() >= B - 1e-12]
    return min(feas, key=lambda c: np.sum((c - y) ** 2))


def test_projection_identity_inside_domain():
    rng = np.random.default_rng(0)
    y = rng.uniform(0, 1, size=(50, 7))
    B = y.sum(-1) * rng.uniform(0.1, 1.0, size=50)
    np.testing.assert_array_equal(project_regret_domain(y, B), y)


def test_projection_matches_brute_force_and_kkt():
    rng = np.random.default_rng(1)
    for _ in range(200):
        d = int(rng.integers(1, 7))
        y = rng.normal(size=d) * rng.choice([0.01, 1.0, 100.0])
        B = float(rng.uniform(0.01, 5.0))
        w = project_regret_domain(y, B)
        assert w.min() >= 0 and w.sum() >= B * (1 - 1e-12)
        np.testing.assert_allclose(w, _brute_projection(y, B), atol=1e-9, rtol=0)
        # KKT: w = [y + mu]^+ with mu >= 0 and mu * (sum w - B) = 0
        pos = w > 0
        mu = float(np.mean(w[pos] - y[pos]))
        np.testing.assert_allclose(w[pos] - y[pos], mu, atol=1e-10)
        assert mu >= -1e-10 and abs(mu * (w.sum() - B)) < 1e-8
        assert np.all(y[~pos] + mu <= 1e-10)


def test_projection_batched_equals_rowwise():
    rng = np.random.default_rng(2)
    Y = rng.normal(size=(30, 5))
    B = rng.uniform(0.1, 3, size=30)
    W = project_regret_domain(Y, B)
    for i in range(30):
        np.testing.assert_allclose(W[i], project_regret_domain(Y[i], B[i]), atol=1e-15)


def test_normalize_zero_is_uniform():
    out = normalize(np.zeros((2, 4)))
    np.testing.assert_array_equal(out, np.full((2, 4), 0.25))


# ------------------------------------------------------------------------------ minimiser checks


@pytest.mark.parametrize("algo", ALL, ids=lambda a: a.label)
def test_strategies_stay_in_simplex(algo):
    A = np.random.default_rng(3).uniform(-1, 1, size=(6, 4))
    for x, y in _selfplay_strategies(algo, A, 300):
        for s in (x, y):
            assert s.min() >= 0.0
            assert abs(s.sum() - 1.0) <= 1e-12


@pytest.mark.parametrize("algo", [RMPlus(), PRMPlus(), MISPRMPlus()], ids=lambda a: a.label)
def test_scale_invariance(algo):
    """RM+/PRM+ and the parameter-free MI-SPRM+ play the same strategies when A is multiplied by 5."""
    A = np.random.default_rng(4).uniform(-1, 1, size=(5, 7))
    for (x1, y1), (x2, y2) in zip(_selfplay_strategies(algo, A, 400), _selfplay_strategies(algo, 5 * A, 400)):
        np.testing.assert_allclose(x1, x2, atol=1e-10)
        np.testing.assert_allclose(y1, y2, atol=1e-10)


def test_sprm_is_not_scale_invariant():
    """Contrast: SPRM+'s fixed step makes it depend on the payoff scale (why MI-SPRM+ matters)."""
    A = np.random.default_rng(4).uniform(-1, 1, size=(5, 7))
    a = SPRMPlus(eta=0.05)
    diff = max(np.abs(x1 - x2).max() for (x1, _), (x2, _) in
               zip(_selfplay_strategies(a, A, 200), _selfplay_strategies(a, 5 * A, 200)))
    assert diff > 1e-3


def _lp_row_strategy(A):
    """Minimax strategy of the row (minimising) player and the game value, by linear programming."""
    from scipy.optimize import linprog

    m, n = A.shape
    c = np.r_[np.zeros(m), 1.0]  # minimise v s.t. A^T x <= v, x in simplex
    res = linprog(c, A_ub=np.c_[A.T, -np.ones(n)], b_ub=np.zeros(n), A_eq=np.r_[np.ones(m), 0.0][None],
                  b_eq=[1.0], bounds=[(0, None)] * m + [(None, None)])
    return res.x[:m], res.x[m]


@pytest.mark.parametrize("algo", ALL, ids=lambda a: a.label)
def test_rock_paper_scissors_variants(algo):
    res = solve_matrix_game(RPS, algo, 500)
    np.testing.assert_allclose(res.x_bar, 1 / 3, atol=1e-12)  # uniform is the equilibrium: stays there
    assert res.gap < 1e-12
    W = np.array([[0.0, 2.0, -1.0], [-2.0, 0.0, 3.0], [1.0, -3.0, 0.0]])  # weighted RPS, interior equilibrium
    x_star, v = _lp_row_strategy(W)
    assert x_star.min() > 0.05
    res = solve_matrix_game(W, algo, 4000)
    assert res.gap < 0.05
    assert res.gap_curve[-1] < res.gap_curve[0] / 5
    np.testing.assert_allclose(res.x_bar, x_star, atol=0.03)
    assert float(res.x_bar @ W @ res.y_bar) == pytest.approx(v, abs=0.03)


def test_sprm_large_eta_tiny_r0_reduces_to_prm():
    A = np.random.default_rng(5).uniform(-1, 1, size=(4, 6))
    sprm = SPRMPlus(eta=1e6, r0=1e-12)
    for (x1, y1), (x2, y2) in zip(_selfplay_strategies(PRMPlus(), A, 200), _selfplay_strategies(sprm, A, 200)):
        np.testing.assert_allclose(x1, x2, atol=1e-9)
        np.testing.assert_allclose(y1, y2, atol=1e-9)


def test_mi_sprm_bound_is_monotone_and_scale_free():
    A = np.random.default_rng(6).uniform(-1, 1, size=(8, 8))
    X, Y = MISPRMPlus().make(8), MISPRMPlus().make(8)
    prev = None
    for t in range(500):
        x, y = X.next_strategy(), Y.next_strategy()
        if t == 0:
            np.testing.assert_array_equal(x, np.full(8, 1 / 8))
            r1 = (x @ (A @ y)) - A @ y
        X.observe_loss(A @ y)
        Y.observe_loss(-A.T @ x)
        if t == 0:
            # B_1 = ||r_1||_1: the first observed regret sets the scale (no hidden constant)
            assert X.B == pytest.approx(np.abs(r1).sum(), rel=1e-12)
        if prev is not None:
            assert X.B >= prev
        prev = float(X.B)
        assert np.all(X.R >= 0) and X.R.sum() >= X.B * (1 - 1e-12)
        assert X.eta_eff == pytest.approx(1.0 / X.B)
    assert X.b_decreases == 0 and Y.b_decreases == 0


def test_mi_sprm_converges_fast_on_random_games():
    """O(1/T) regime: MI-SPRM+'s gap falls ~10x per decade and is far below RM+'s."""
    A = np.random.default_rng(7).uniform(-1, 1, size=(10, 10, 10))
    mi = solve_matrix_game(A, MISPRMPlus(), 3000, log_at=[30, 300, 3000])
    rmp = solve_matrix_game(A, RMPlus(), 3000, log_at=[30, 300, 3000])
    assert np.median(mi.slope(30, 3000)) < -0.85
    assert np.median(mi.gap) * 3 < np.median(rmp.gap)
    assert mi.b_decreases == 0


def test_batched_equals_single_game():
    A = np.random.default_rng(8).uniform(-1, 1, size=(3, 4, 5))
    batch = solve_matrix_game(A, MISPRMPlus(), 200)
    for g in range(3):
        single = solve_matrix_game(A[g], MISPRMPlus(), 200)
        np.testing.assert_allclose(batch.x_bar[g], single.x_bar, atol=1e-13)
        np.testing.assert_allclose(batch.gap_curve[g], single.gap_curve, atol=1e-13)


def test_options_alternating_and_averaging():
    A = np.random.default_rng(9).uniform(-1, 1, size=(6, 6))
    base = solve_matrix_game(A, PRMPlus(), 500)
    for kw in ({"alternating": True}, {"averaging": "linear"}, {"averaging": "quadratic"}):
        r = solve_matrix_game(A, PRMPlus(), 500, **kw)
        assert not np.allclose(r.x_bar, base.x_bar)
        assert r.gap < 0.05
    assert abs(duality_gap(A, base.x_bar, base.y_bar) - base.gap) < 1e-12


def test_torch_input_accepted():
    torch = pytest.importorskip("torch")
    A = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) * 2 - 1
    res = solve_matrix_game(A, MISPRMPlus(), 100, log_every=10)
    assert res.log_iters.tolist() == list(range(10, 101, 10))
    assert res.x_bar.shape == (4,)


# ------------------------------------------------------------------------------- edge cases


def test_constant_game_gap_stays_zero():
    A = np.full((3, 4), 2.5)
    for algo in ALL:
        res = solve_matrix_game(A, algo, 200)
        np.testing.assert_allclose(res.gap_curve, 0.0, atol=1e-12)
        np.testing.assert_allclose(res.x_bar, 1 / 3, atol=1e-12)
        assert np.all(np.isfinite(res.eta_eff["x"]))


def test_dominant_strategy_games_stay_finite():
    A = np.array([[[-1.0, -0.5], [1.0, 2.0]], [[0.0, 3.0], [1.0, 4.0]]])  # pure dominant strategies
    res = solve_matrix_game(A, MISPRMPlus(), 20_000, log_at=[20_000])
    assert np.all(np.isfinite(res.gap_curve)) and np.all(np.isfinite(res.eta_eff["x"]))
    assert np.all(res.gap < 1e-3)
    np.testing.assert_allclose(res.x_bar[0], [1, 0], atol=1e-3)


@pytest.mark.slow
def test_dominant_strategy_one_million_iterations():
    A = np.array([[-1.0, -0.5], [1.0, 2.0]])
    res = solve_matrix_game(A, MISPRMPlus(), 1_000_000, log_at=[1_000_000])
    assert np.isfinite(res.gap) and np.all(np.isfinite(res.eta_eff["x"]))


# -------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("A", [np.array([[1.0, np.nan]]), np.array([[np.inf, 0.0]]), np.zeros((0, 3)),
                               np.zeros((3, 0)), np.zeros(4), np.zeros((1, 2, 3, 4))])
def test_bad_payoff_matrix(A):
    with pytest.raises(ValueError):
        solve_matrix_game(A, MISPRMPlus(), 10)


def test_bad_arguments():
    A = np.eye(3)
    with pytest.raises(ValueError, match="strategy shapes"):
        duality_gap(A, np.ones(2) / 2, np.ones(3) / 3)
    with pytest.raises(ValueError, match="averaging"):
        solve_matrix_game(A, MISPRMPlus(), 10, averaging="cubic")
    with pytest.raises(ValueError, match="iters"):
        solve_matrix_game(A, MISPRMPlus(), 0)
    with pytest.raises(TypeError):
        solve_matrix_game(A, "rm+", 10)
    with pytest.raises(ValueError, match="log_at"):
        solve_matrix_game(A, MISPRMPlus(), 10, log_at=[20])
    with pytest.raises(ValueError, match="eta"):
        SPRMPlus(eta=-1.0)
    with pytest.raises(ValueError, match="r0"):
        SPRMPlus(eta=0.1, r0=float("nan"))
    with pytest.raises(ValueError, match="ard"):
        MISPRMPlus(ard="grow")
    m = MISPRMPlus().make(3)
    with pytest.raises(ValueError, match="shape"):
        m.observe_loss(np.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        m.observe_loss(np.array([0.0, np.nan, 1.0]))
    with pytest.raises(ValueError):
        MISPRMPlus().make(0)


def test_config_is_frozen_and_registered():
    from rankwise.core import registry

    with pytest.raises(Exception):
        MISPRMPlus().ard = "norm"  # type: ignore[misc]
    entry = registry.get("mi_sprm")
    assert entry.config is MISPRMPlus and entry.entry is solve_matrix_game


# --------------------------------------------------------------------------- extensive form


def test_game_sizes():
    k = build_sequence_form(KuhnPoker())
    assert [tp.num_infosets for tp in k.players] == [6, 6]
    l_ = build_sequence_form(LeducPoker())
    assert sum(tp.num_infosets for tp in l_.players) == 936


def test_kuhn_cfr_converges_to_game_value():
    res = CFRSolver(KuhnPoker(), local=MISPRMPlus(), averaging="quadratic").run(2000, log_at=[10, 100, 2000])
    assert res.value == pytest.approx(-1 / 18, abs=1e-3)
    assert res.exploitability[-1] < 1e-4 < res.exploitability[0]
    assert res.b_decreases == 0
    for pol in res.average_policy:
        for probs in pol.values():
            assert abs(sum(probs.values()) - 1) < 1e-12 and min(probs.values()) >= 0


def test_exploitability_matches_openspiel_on_random_policies():
    pytest.importorskip("pyspiel")
    from rankwise.science.mi_sprm import openspiel_exploitability

    rng = np.random.default_rng(0)
    for game in (KuhnPoker(), LeducPoker()):
        solver = CFRSolver(game, local=RMPlus())
        sf = solver.sf
        plans = []
        for tp in sf.players:
            beh = np.zeros(tp.num_seqs)
            for k, sm in tp.group_seqs.items():
                beh[sm] = rng.dirichlet(np.ones(k), size=sm.shape[0])
            plans.append((tp, beh))
        pol = [tp.policy_dict(beh) for tp, beh in plans]
        native = sf.exploitability(plans[0][0].realization(plans[0][1]), plans[1][0].realization(plans[1][1]))
        assert native == pytest.approx(openspiel_exploitability(game, pol), abs=1e-10)


def test_native_cfr_plus_reproduces_openspiel_cfr_plus():
    pytest.importorskip("pyspiel")
    from rankwise.science.mi_sprm import openspiel_cfr_curve

    for game, n in ((KuhnPoker(), 200), (LeducPoker(), 20)):
        ours = CFRSolver(game, RMPlus(), alternating=True, averaging="linear").run(n, log_at=[n // 2, n])
        _, theirs, _ = openspiel_cfr_curve(game.name, n, plus=True, log_at=[n // 2, n])
        np.testing.assert_allclose(ours.exploitability, theirs, rtol=1e-6, atol=1e-12)


def test_openspiel_adapter_equals_native():
    pytest.importorskip("pyspiel")
    from rankwise.science.mi_sprm import OpenSpielGame

    a = CFRSolver(OpenSpielGame("kuhn_poker"), MISPRMPlus()).run(100, log_at=[100])
    b = CFRSolver(KuhnPoker(), MISPRMPlus()).run(100, log_at=[100])
    assert a.exploitability[-1] == pytest.approx(b.exploitability[-1], rel=1e-10)


def test_imperfect_recall_game_rejected():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class S:
        h: tuple = ()

        def is_terminal(self):
            return len(self.h) == 2

        def current_player(self):
            return 0

        def legal_actions(self):
            return [0, 1]

        def chance_outcomes(self):
            return []

        def child(self, a):
            return S(self.h + (a,))

        def infoset_key(self):
            return "same" if len(self.h) == 1 else "root"  # forgets its own first action

        def returns(self):
            return float(sum(self.h))

    class Forgetful:
        name = "forgetful"

        def root(self):
            return S()

    with pytest.raises(ValueError, match="perfect recall"):
        build_sequence_form(Forgetful())


def test_cfr_bad_arguments():
    with pytest.raises(TypeError):
        CFRSolver(KuhnPoker(), local="pcfr+")
    with pytest.raises(ValueError, match="averaging"):
        CFRSolver(KuhnPoker(), averaging="exp")
    with pytest.raises(ValueError, match="iters"):
        CFRSolver(KuhnPoker()).run(0)


def test_overflow_raises_numerical_error_not_nan():
    m = RM().make(2)
    with pytest.raises(NumericalError, match="non-finite"):
        for _ in range(3):
            m.observe_loss(np.array([1e308, -1e308]))
