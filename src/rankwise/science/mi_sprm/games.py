"""Native two-player zero-sum extensive-form games (Kuhn and Leduc poker) and an OpenSpiel adapter.

A game exposes ``root()``; states expose

* ``is_terminal()``, ``current_player()`` (0, 1, or :data:`CHANCE` = -1),
* ``legal_actions()`` (list of ints), ``chance_outcomes()`` (list of ``(action, prob)``),
* ``child(action)`` (a new state; states are immutable),
* ``infoset_key()`` (a string identifying the acting player's information set),
* ``returns()`` (utility of player 0 at a terminal; player 1 gets the negative).

Action encodings follow OpenSpiel's ``kuhn_poker`` and ``leduc_poker`` (chance outcomes are card
ids, Kuhn: 0 = pass, 1 = bet; Leduc: 0 = fold, 1 = call/check, 2 = raise), so a native history
replays in OpenSpiel and the two implementations can be cross-checked state by state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

__all__ = ["CHANCE", "GameState", "Game", "KuhnPoker", "LeducPoker", "OpenSpielGame", "replay"]

CHANCE = -1


class GameState(Protocol):
    def is_terminal(self) -> bool: ...
    def current_player(self) -> int: ...
    def legal_actions(self) -> list[int]: ...
    def chance_outcomes(self) -> list[tuple[int, float]]: ...
    def child(self, action: int) -> "GameState": ...
    def infoset_key(self) -> str: ...
    def returns(self) -> float: ...


class Game(Protocol):
    name: str

    def root(self) -> GameState: ...


def replay(game: Game, history: Sequence[int]) -> GameState:
    """The state reached from ``game.root()`` by the action sequence ``history`` (chance actions included)."""
    s = game.root()
    for a in history:
        s = s.child(int(a))
    return s


# ------------------------------------------------------------------------------------------- Kuhn


@dataclass(frozen=True)
class _KuhnState:
    cards: tuple[int, ...] = ()
    bets: tuple[int, ...] = ()  # 0 = pass, 1 = bet

    def is_terminal(self) -> bool:
        b = self.bets
        return b in ((0, 0), (1, 0), (1, 1), (0, 1, 0), (0, 1, 1))

    def current_player(self) -> int:
        if len(self.cards) < 2:
            return CHANCE
        return len(self.bets) % 2

    def legal_actions(self) -> list[int]:
        if len(self.cards) < 2:
            return [a for a, _ in self.chance_outcomes()]
        return [] if self.is_terminal() else [0, 1]

    def chance_outcomes(self) -> list[tuple[int, float]]:
        if len(self.cards) >= 2:
            return []
        rest = [c for c in range(3) if c not in self.cards]
        return [(c, 1.0 / len(rest)) for c in rest]

    def child(self, action: int) -> "_KuhnState":
        if action not in self.legal_actions():
            raise ValueError(f"illegal action {action} in Kuhn state {self}")
        if len(self.cards) < 2:
            return _KuhnState(self.cards + (action,), self.bets)
        return _KuhnState(self.cards, self.bets + (action,))

    def infoset_key(self) -> str:
        p = self.current_player()
        return f"{self.cards[p]}|" + "".join("pb"[a] for a in self.bets)

    def returns(self) -> float:
        b = self.bets
        win = 1.0 if self.cards[0] > self.cards[1] else -1.0
        if b == (0, 0):
            return win
        if b == (1, 0):
            return 1.0
        if b == (0, 1, 0):
            return -1.0
        return 2.0 * win  # (1, 1) or (0, 1, 1)


@dataclass(frozen=True)
class KuhnPoker:
    """Kuhn poker (3 cards, ante 1, one bet of 1); 12 information sets; game value -1/18 for player 0."""

    name: str = "kuhn_poker"

    def root(self) -> _KuhnState:
        return _KuhnState()


# ------------------------------------------------------------------------------------------ Leduc


@dataclass(frozen=True)
class _LeducState:
    cards: tuple[int, ...] = ()  # (card of p0, card of p1, public card); card c has rank c // 2
    rounds: tuple[tuple[int, ...], ...] = ((),)  # betting actions per round: 0 fold, 1 call, 2 raise
    contrib: tuple[int, int] = (1, 1)  # ante 1 each

    # -- helpers
    def _round(self) -> int:
        return len(self.rounds) - 1

    def _folded(self) -> bool:
        return any(0 in r for r in self.rounds)

    @staticmethod
    def _round_over(r: tuple[int, ...]) -> bool:
        # ends with check-check, or a call after at least one raise
        if len(r) >= 2 and r[-1] == 1 and (r[-2] == 2 or r == (1, 1)):
            return True
        return 2 in r and r[-1] == 1

    def _need_chance(self) -> bool:
        if len(self.cards) < 2:
            return True
        return len(self.cards) == 2 and self._round_over(self.rounds[0]) and not self._folded()

    def is_terminal(self) -> bool:
        if self._folded():
            return True
        return len(self.rounds) == 2 and self._round_over(self.rounds[1])

    def current_player(self) -> int:
        if self.is_terminal():
            return -4  # OpenSpiel's kTerminalPlayerId
        if self._need_chance():
            return CHANCE
        return len(self.rounds[-1]) % 2  # player 0 starts each round

    def _raises(self) -> int:
        return sum(1 for a in self.rounds[-1] if a == 2)

    def legal_actions(self) -> list[int]:
        if self.is_terminal():
            return []
        if self._need_chance():
            return [a for a, _ in self.chance_outcomes()]
        p = self.current_player()
        acts = []
        if self.contrib[1 - p] > self.contrib[p]:
            acts.append(0)  # fold only when facing a bet
        acts.append(1)
        if self._raises() < 2:
            acts.append(2)
        return acts

    def chance_outcomes(self) -> list[tuple[int, float]]:
        if not self._need_chance():
            return []
        rest = [c for c in range(6) if c not in self.cards]
        return [(c, 1.0 / len(rest)) for c in rest]

    def child(self, action: int) -> "_LeducState":
        if action not in self.legal_actions():
            raise ValueError(f"illegal action {action} in Leduc state {self}")
        if self._need_chance():
            cards = self.cards + (action,)
            rounds = self.rounds if len(cards) <= 2 else self.rounds + ((),)
            return _LeducState(cards, rounds, self.contrib)
        p = self.current_player()
        c = list(self.contrib)
        if action == 1:
            c[p] = c[1 - p]
        elif action == 2:
            c[p] = c[1 - p] + (2 if self._round() == 0 else 4)
        rounds = self.rounds[:-1] + (self.rounds[-1] + (action,),)
        return _LeducState(self.cards, rounds, (c[0], c[1]))

    def infoset_key(self) -> str:
        p = self.current_player()
        pub = str(self.cards[2]) if len(self.cards) > 2 else "-"
        hist = "/".join("".join("fcr"[a] for a in r) for r in self.rounds)
        return f"{p}|{self.cards[p]}|{pub}|{hist}"

    def returns(self) -> float:
        for r_i, r in enumerate(self.rounds):
            if 0 in r:
                folder = (len(r) - 1) % 2
                return float(self.contrib[1]) if folder == 1 else -float(self.contrib[0])
        pub = self.cards[2] // 2
        r0, r1 = self.cards[0] // 2, self.cards[1] // 2
        s0 = (1, r0) if r0 == pub else (0, r0)
        s1 = (1, r1) if r1 == pub else (0, r1)
        if s0 == s1:
            return 0.0
        return float(self.contrib[1]) if s0 > s1 else -float(self.contrib[0])


@dataclass(frozen=True)
class LeducPoker:
    """Leduc poker (OpenSpiel rules): 6 cards (3 ranks x 2 suits), ante 1, raises 2 then 4, at most 2
    raises per round, fold only when facing a bet; pair with the public card wins, then higher rank.
    936 information sets."""

    name: str = "leduc_poker"

    def root(self) -> _LeducState:
        return _LeducState()


# --------------------------------------------------------------------------------- OpenSpiel adapter


@dataclass
class _OSState:
    state: Any

    def is_terminal(self) -> bool:
        return bool(self.state.is_terminal())

    def current_player(self) -> int:
        return int(self.state.current_player())

    def legal_actions(self) -> list[int]:
        return [int(a) for a in self.state.legal_actions()]

    def chance_outcomes(self) -> list[tuple[int, float]]:
        return [(int(a), float(p)) for a, p in self.state.chance_outcomes()]

    def child(self, action: int) -> "_OSState":
        return _OSState(self.state.child(int(action)))

    def infoset_key(self) -> str:
        return str(self.state.information_state_string())

    def returns(self) -> float:
        return float(self.state.returns()[0])


@dataclass
class OpenSpielGame:
    """Any two-player zero-sum, perfect-recall OpenSpiel game (``pyspiel`` imported lazily).

    ``OpenSpielGame("kuhn_poker")`` or ``OpenSpielGame(pyspiel.load_game(...))``; information sets
    are keyed by OpenSpiel's ``information_state_string``.
    """

    game: Any
    name: str = field(default="")

    def __post_init__(self) -> None:
        if isinstance(self.game, str):
            try:
                import pyspiel
            except ImportError as e:  # pragma: no cover - optional dependency
                raise ImportError("OpenSpielGame needs open_spiel (`pip install rankwise[peers]`)") from e
            self.game = pyspiel.load_game(self.game)
        if not self.name:
            self.name = str(self.game.get_type().short_name)
        if int(self.game.num_players()) != 2:
            raise ValueError(f"OpenSpielGame: only two-player games are supported, got {self.game.num_players()}")

    def root(self) -> _OSState:
        return _OSState(self.game.new_initial_state())
