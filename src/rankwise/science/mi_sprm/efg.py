"""CFR with pluggable local regret minimisers on two-player zero-sum extensive-form games.

The game tree is compiled once into its sequence form: for each player a treeplex (information
sets, their parent sequence, their actions' sequence ids) and a sparse payoff matrix ``A`` with
``A[s0, s1] = sum over terminals z reached by sequences (s0, s1) of chance(z) * u_0(z)``; the
expected utility of player 0 is ``x^T A y`` for realisation plans ``x``, ``y``.

One CFR iteration (Zinkevich et al. 2007, in vector form): the counterfactual value of each
sequence of player 0 is ``(A y)[s]`` plus the expected value of the information sets below it
(bottom-up pass); information set ``I``'s local loss is ``-cv(I, .)`` and its local minimiser (one
batched :class:`~rankwise.science.mi_sprm.regret.RegretMinimizer` per action count) produces the
next behavioural strategy. With RM+ and alternating updates plus linear averaging this is CFR+
(Tammelin 2014); with PRM+ it is PCFR+ (Farina et al. 2021); with MI-SPRM+ it is the spec's
"PCFR+-style with the ARD projection".

Exploitability is computed exactly by best responses on the treeplexes; it matches OpenSpiel's
``exploitability`` (NashConv / 2) on kuhn_poker and leduc_poker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import scipy.sparse as sp

from rankwise.core.errors import NumericalError
from rankwise.core.validate import check_choice, check_int
from rankwise.science.mi_sprm.games import CHANCE, Game, GameState, replay
from rankwise.science.mi_sprm.matrix import fit_loglog_slope, log_schedule
from rankwise.science.mi_sprm.regret import MISPRMPlus, RegretAlgorithm, RegretMinimizer, _MISPRMPlus

__all__ = ["Treeplex", "SequenceForm", "build_sequence_form", "CFRSolver", "CFRResult",
           "openspiel_exploitability", "openspiel_cfr_curve"]


@dataclass
class Treeplex:
    """One player's decision structure in sequence form.

    Sequence 0 is the empty sequence; information set ``I`` owns the contiguous sequences
    ``first_seq[I] .. first_seq[I] + n_actions[I] - 1`` (one per legal action, in ``actions[I]``
    order) and hangs below sequence ``parent_seq[I]``; ``depth[I]`` counts the player's earlier
    decisions.
    """

    keys: list[str]
    actions: list[list[int]]
    parent_seq: np.ndarray
    first_seq: np.ndarray
    n_actions: np.ndarray
    depth: np.ndarray
    num_seqs: int
    # derived (filled by _finalize)
    seq_parent: np.ndarray = field(default=None)  # type: ignore[assignment]  parent sequence of each sequence (-1 for 0)
    levels: list[np.ndarray] = field(default_factory=list)  # sequence ids per depth, shallow -> deep
    groups: dict[int, np.ndarray] = field(default_factory=dict)  # k -> infoset ids with k actions
    group_seqs: dict[int, np.ndarray] = field(default_factory=dict)  # k -> (n_k, k) sequence ids
    level_groups: list[list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)  # per depth: (seqmat, parent)

    @property
    def num_infosets(self) -> int:
        return len(self.keys)

    def _finalize(self) -> None:
        sp_ = np.full(self.num_seqs, -1, dtype=np.int64)
        seq_depth = np.full(self.num_seqs, -1, dtype=np.int64)
        for I in range(self.num_infosets):
            s = np.arange(self.first_seq[I], self.first_seq[I] + self.n_actions[I])
            sp_[s] = self.parent_seq[I]
            seq_depth[s] = self.depth[I]
        self.seq_parent = sp_
        D = int(self.depth.max()) + 1 if self.num_infosets else 0
        self.levels = [np.nonzero(seq_depth == d)[0] for d in range(D)]
        for k in np.unique(self.n_actions):
            ids = np.nonzero(self.n_actions == k)[0]
            self.groups[int(k)] = ids
            self.group_seqs[int(k)] = self.first_seq[ids][:, None] + np.arange(k)[None, :]
        self.level_groups = []
        for d in range(D):
            lg = []
            for k in np.unique(self.n_actions[self.depth == d]):
                ids = np.nonzero((self.depth == d) & (self.n_actions == k))[0]
                lg.append((self.first_seq[ids][:, None] + np.arange(k)[None, :], self.parent_seq[ids]))
            self.level_groups.append(lg)

    def realization(self, beh: np.ndarray) -> np.ndarray:
        """Realisation plan (num_seqs,) from a per-sequence behavioural strategy ``beh`` (num_seqs,)."""
        x = np.zeros(self.num_seqs)
        x[0] = 1.0
        for s in self.levels:
            x[s] = x[self.seq_parent[s]] * beh[s]
        return x

    def counterfactual_values(self, u: np.ndarray, beh: np.ndarray) -> np.ndarray:
        """Bottom-up pass: ``cv[s] = u[s] + sum_{I below s} sum_a beh(I,a) cv(I,a)``; shape (num_seqs,)."""
        cv = np.array(u, dtype=np.float64, copy=True)
        for s in reversed(self.levels):
            cv += np.bincount(self.seq_parent[s], weights=beh[s] * cv[s], minlength=self.num_seqs)
        return cv

    def best_response_value(self, u: np.ndarray) -> float:
        """``max over realisation plans z of z . u`` (bottom-up with max at every information set)."""
        cv = np.array(u, dtype=np.float64, copy=True)
        for lg in reversed(self.level_groups):
            for seqmat, parent in lg:
                cv += np.bincount(parent, weights=cv[seqmat].max(axis=1), minlength=self.num_seqs)
        return float(cv[0])

    def behavioural(self, x: np.ndarray) -> np.ndarray:
        """Per-sequence behavioural strategy from a realisation plan (uniform where unreachable)."""
        beh = np.zeros(self.num_seqs)
        for k, sm in self.group_seqs.items():
            xs = x[sm]
            tot = xs.sum(axis=1, keepdims=True)
            beh[sm] = np.where(tot > 0, xs / np.where(tot > 0, tot, 1.0), 1.0 / k)
        return beh

    def policy_dict(self, beh: np.ndarray) -> dict[str, dict[int, float]]:
        """``{infoset key: {action: prob}}`` from a per-sequence behavioural strategy."""
        return {key: {a: float(beh[self.first_seq[I] + j]) for j, a in enumerate(self.actions[I])}
                for I, key in enumerate(self.keys)}


@dataclass
class SequenceForm:
    """Sequence form of a two-player zero-sum game: ``u_0 = x^T A y``; ``A`` sparse (n0_seqs, n1_seqs)."""

    name: str
    A: sp.csr_matrix
    players: tuple[Treeplex, Treeplex]
    num_histories: int

    @property
    def AT(self) -> sp.csr_matrix:
        if not hasattr(self, "_AT"):
            self._AT = self.A.T.tocsr()
        return self._AT

    def nash_conv(self, x: np.ndarray, y: np.ndarray) -> float:
        """``BR_0(y) + BR_1(x)`` for realisation plans ``x``, ``y`` (0 at a Nash equilibrium)."""
        br0 = self.players[0].best_response_value(self.A @ y)
        br1 = self.players[1].best_response_value(-(self.AT @ x))
        return br0 + br1

    def exploitability(self, x: np.ndarray, y: np.ndarray) -> float:
        """NashConv / 2, OpenSpiel's ``exploitability`` convention."""
        return 0.5 * self.nash_conv(x, y)

    def value(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(x @ (self.A @ y))


def build_sequence_form(game: Game) -> SequenceForm:
    """Walk the game tree once and build its :class:`SequenceForm`.

    Raises ``ValueError`` when the game is not two-player, not perfect-recall (an information set
    reached under two different own sequences) or inconsistent (different legal actions in one
    information set), or has chance probabilities that do not sum to 1.
    """
    keys: list[dict[str, int]] = [{}, {}]
    acts: list[list[list[int]]] = [[], []]
    par: list[list[int]] = [[], []]
    first: list[list[int]] = [[], []]
    depth: list[list[int]] = [[], []]
    nseq = [1, 1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    count = [0]

    def walk(s: GameState, seq: tuple[int, int], dep: tuple[int, int], pc: float) -> None:
        count[0] += 1
        if s.is_terminal():
            u = float(s.returns())
            if not np.isfinite(u):
                raise ValueError(f"game {getattr(game, 'name', game)}: non-finite terminal utility {u}")
            rows.append(seq[0])
            cols.append(seq[1])
            vals.append(pc * u)
            return
        p = s.current_player()
        if p == CHANCE:
            outs = s.chance_outcomes()
            tot = sum(q for _, q in outs)
            if abs(tot - 1.0) > 1e-9:
                raise ValueError(f"chance probabilities sum to {tot}, not 1")
            for a, q in outs:
                if q > 0:
                    walk(s.child(a), seq, dep, pc * q)
            return
        if p not in (0, 1):
            raise ValueError(f"only two-player games are supported; got current_player {p}")
        la = list(s.legal_actions())
        if not la:
            raise ValueError("a non-terminal decision node has no legal actions")
        key = s.infoset_key()
        I = keys[p].get(key)
        if I is None:
            I = keys[p][key] = len(acts[p])
            acts[p].append(la)
            par[p].append(seq[p])
            first[p].append(nseq[p])
            depth[p].append(dep[p])
            nseq[p] += len(la)
        else:
            if par[p][I] != seq[p]:
                raise ValueError(f"information set {key!r} of player {p} is reached by two different own "
                                 f"sequences: the game does not have perfect recall")
            if acts[p][I] != la:
                raise ValueError(f"information set {key!r} has inconsistent legal actions {acts[p][I]} vs {la}")
        for j, a in enumerate(la):
            ns = list(seq)
            ns[p] = first[p][I] + j
            nd = list(dep)
            nd[p] += 1
            walk(s.child(a), (ns[0], ns[1]), (nd[0], nd[1]), pc)

    walk(game.root(), (0, 0), (0, 0), 1.0)
    tps = []
    for p in (0, 1):
        tp = Treeplex(keys=list(keys[p]), actions=acts[p], parent_seq=np.asarray(par[p], dtype=np.int64),
                      first_seq=np.asarray(first[p], dtype=np.int64),
                      n_actions=np.asarray([len(a) for a in acts[p]], dtype=np.int64),
                      depth=np.asarray(depth[p], dtype=np.int64), num_seqs=nseq[p])
        tp._finalize()
        tps.append(tp)
    A = sp.coo_matrix((vals, (rows, cols)), shape=(nseq[0], nseq[1])).tocsr()
    A.sum_duplicates()
    return SequenceForm(name=str(getattr(game, "name", type(game).__name__)), A=A,
                        players=(tps[0], tps[1]), num_histories=count[0])


_SF_CACHE: dict[Any, SequenceForm] = {}


def _sequence_form(game: Game | SequenceForm) -> SequenceForm:
    if isinstance(game, SequenceForm):
        return game
    try:
        hash(game)
        key: Any = game
    except TypeError:
        key = None
    if key is not None and key in _SF_CACHE:
        return _SF_CACHE[key]
    sf = build_sequence_form(game)
    if key is not None:
        _SF_CACHE[key] = sf
    return sf


@dataclass
class CFRResult:
    """Outcome of :meth:`CFRSolver.run`.

    - ``log_iters`` (L,), ``exploitability`` (L,): NashConv/2 of the average strategy (OpenSpiel's
      convention) at each logged iteration; ``nash_conv`` = 2 x exploitability;
    - ``average_policy`` / ``current_policy``: ``[{infoset key: {action: prob}}, {...}]`` per player;
    - ``value``: player 0's expected utility under the average strategies;
    - ``b_decreases``: steps where some MI-SPRM+ bound ``B_t`` decreased (0 by construction).
    """

    algo: str
    game: str
    iters: int
    log_iters: np.ndarray
    exploitability: np.ndarray
    average_policy: list[dict[str, dict[int, float]]]
    current_policy: list[dict[str, dict[int, float]]]
    value: float
    b_decreases: int | None = None
    wall_time_s: float = 0.0

    @property
    def nash_conv(self) -> np.ndarray:
        return 2.0 * self.exploitability

    def slope(self, lo: float | None = None, hi: float | None = None) -> float:
        """Log-log slope of exploitability over ``[lo, hi]`` (default the last two decades)."""
        hi = self.iters if hi is None else hi
        lo = max(1.0, hi / 100.0) if lo is None else lo
        return fit_loglog_slope(self.log_iters, self.exploitability, lo, hi)


class CFRSolver:
    """Counterfactual regret minimisation with any local regret minimiser.

    Args:
        game: a native game (:class:`~rankwise.science.mi_sprm.games.KuhnPoker`, ``LeducPoker``), an
            :class:`~rankwise.science.mi_sprm.games.OpenSpielGame`, anything with the same protocol,
            or a prebuilt :class:`SequenceForm`.
        local: regret-minimiser config used at every information set (default MI-SPRM+).
        alternating: update player 0 first, then player 1 against player 0's updated strategy (CFR+).
        averaging: weights of the average strategy: ``uniform`` (1), ``linear`` (t), ``quadratic`` (t^2).

    Example::

        solver = CFRSolver(KuhnPoker(), local=MISPRMPlus())
        res = solver.run(10_000)
        print(res.exploitability[-1], res.slope())
    """

    def __init__(self, game: Game | SequenceForm, local: RegretAlgorithm | None = None, *,
                 alternating: bool = True, averaging: Literal["uniform", "linear", "quadratic"] = "uniform") -> None:
        self.local = MISPRMPlus() if local is None else local
        if not isinstance(self.local, RegretAlgorithm):
            raise TypeError(f"local must be a RegretAlgorithm config (e.g. MISPRMPlus()), got {type(self.local).__name__}")
        check_choice("averaging", averaging, ("uniform", "linear", "quadratic"))
        self.sf = _sequence_form(game)
        self.alternating = bool(alternating)
        self.averaging = averaging
        self._power = {"uniform": 0, "linear": 1, "quadratic": 2}[averaging]
        self.minimizers: list[dict[int, RegretMinimizer]] = [
            {k: self.local.make(k, (len(ids),)) for k, ids in tp.groups.items()} for tp in self.sf.players]
        self.sum_plans = [np.zeros(tp.num_seqs) for tp in self.sf.players]
        self.sum_w = [0.0, 0.0]
        self.n_avg = [0, 0]
        self.t = 0

    # -- strategies
    def _beh(self, p: int) -> np.ndarray:
        tp = self.sf.players[p]
        beh = np.zeros(tp.num_seqs)
        for k, mz in self.minimizers[p].items():
            beh[tp.group_seqs[k]] = mz.next_strategy()
        return beh

    def _in_average(self, p: int) -> bool:
        return all(mz.in_average for mz in self.minimizers[p].values())

    def _accumulate(self, p: int, plan: np.ndarray) -> None:
        if self._in_average(p):
            self.n_avg[p] += 1
            w = float(self.n_avg[p]) ** self._power
            self.sum_plans[p] += w * plan
            self.sum_w[p] += w

    def _observe(self, p: int, u: np.ndarray, beh: np.ndarray) -> None:
        tp = self.sf.players[p]
        cv = tp.counterfactual_values(u, beh)
        for k, mz in self.minimizers[p].items():
            mz.observe_loss(-cv[tp.group_seqs[k]])

    def iterate(self) -> None:
        """One CFR iteration (both players update once)."""
        sf = self.sf
        b0, b1 = self._beh(0), self._beh(1)
        x, y = sf.players[0].realization(b0), sf.players[1].realization(b1)
        self._accumulate(0, x)
        self._accumulate(1, y)
        self._observe(0, sf.A @ y, b0)
        if self.alternating:
            x = sf.players[0].realization(self._beh(0))
        self._observe(1, -(sf.AT @ x), b1)
        self.t += 1

    def average_plans(self) -> tuple[np.ndarray, np.ndarray]:
        """Average realisation plans (x̄, ȳ) (current plans before the first iteration)."""
        out = []
        for p in (0, 1):
            if self.sum_w[p] > 0:
                out.append(self.sum_plans[p] / self.sum_w[p])
            else:
                out.append(self.sf.players[p].realization(self._beh(p)))
        return out[0], out[1]

    def exploitability(self) -> float:
        """NashConv/2 of the current average strategy profile."""
        x, y = self.average_plans()
        e = self.sf.exploitability(x, y)
        if not np.isfinite(e):
            raise NumericalError(f"CFR({self.local.label}): exploitability became non-finite at iteration {self.t}")
        return e

    def average_policy(self) -> list[dict[str, dict[int, float]]]:
        x, y = self.average_plans()
        return [tp.policy_dict(tp.behavioural(z)) for tp, z in zip(self.sf.players, (x, y))]

    def current_policy(self) -> list[dict[str, dict[int, float]]]:
        return [tp.policy_dict(self._beh(p)) for p, tp in enumerate(self.sf.players)]

    def run(self, iters: int, *, log_at: Sequence[int] | None = None) -> CFRResult:
        """Run ``iters`` more iterations, logging exploitability at ``log_at`` (default ~60 log-spaced)."""
        check_int("iters", iters, 1)
        logs = log_schedule(iters) if log_at is None else np.unique(np.asarray(list(log_at), dtype=np.int64))
        if logs.size == 0 or logs.min() < 1 or logs.max() > iters:
            raise ValueError(f"log_at must be iterations within [1, {iters}]")
        t_start = self.t
        expl = np.zeros(logs.size)
        li = 0
        t0 = time.perf_counter()
        for i in range(1, iters + 1):
            self.iterate()
            if li < logs.size and i == logs[li]:
                expl[li] = self.exploitability()
                li += 1
        wall = time.perf_counter() - t0
        x, y = self.average_plans()
        bdec = None
        mis = [mz for d in self.minimizers for mz in d.values() if isinstance(mz, _MISPRMPlus)]
        if mis:
            bdec = sum(int(m.b_decreases) for m in mis)
        return CFRResult(algo=self.local.label, game=self.sf.name, iters=int(self.t),
                         log_iters=logs + t_start, exploitability=expl, average_policy=self.average_policy(),
                         current_policy=self.current_policy(), value=self.sf.value(x, y), b_decreases=bdec,
                         wall_time_s=wall)


# ------------------------------------------------------------------------------ OpenSpiel cross-check


def _os_walk(os_game: Any, native: Game, policy: list[dict[str, dict[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}

    def walk(state: Any, hist: list[int]) -> None:
        if state.is_terminal():
            return
        if state.is_chance_node():
            for a, _ in state.chance_outcomes():
                walk(state.child(a), hist + [int(a)])
            return
        p = state.current_player()
        key = state.information_state_string()
        if key not in out:
            ns = replay(native, hist)
            probs = policy[p][ns.infoset_key()]
            out[key] = [(int(a), float(probs[int(a)])) for a in state.legal_actions()]
        for a in state.legal_actions():
            walk(state.child(a), hist + [int(a)])

    walk(os_game.new_initial_state(), [])
    return out


def openspiel_exploitability(native: Game, policy: list[dict[str, dict[int, float]]]) -> float:
    """OpenSpiel's exploitability (NashConv/2) of a native policy, by replaying every history in
    OpenSpiel's own implementation of the same game (``native.name`` must be an OpenSpiel game name)."""
    import pyspiel

    os_game = pyspiel.load_game(native.name)
    return float(pyspiel.exploitability(os_game, _os_walk(os_game, native, policy)))


def openspiel_cfr_curve(game_name: str, iters: int, *, plus: bool = True,
                        log_at: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Exploitability curve of OpenSpiel's C++ CFR (``plus=False``) or CFR+ solver on ``game_name``.

    Returns ``(log_iters, exploitability, wall_time_s)``.
    """
    import pyspiel

    game = pyspiel.load_game(game_name)
    solver = pyspiel.CFRPlusSolver(game) if plus else pyspiel.CFRSolver(game)
    logs = log_schedule(iters) if log_at is None else np.unique(np.asarray(list(log_at), dtype=np.int64))
    expl = np.zeros(logs.size)
    li = 0
    t0 = time.perf_counter()
    for i in range(1, iters + 1):
        solver.evaluate_and_update_policy()
        if li < logs.size and i == logs[li]:
            expl[li] = float(pyspiel.exploitability(game, solver.average_policy()))
            li += 1
    return logs, expl, time.perf_counter() - t0
