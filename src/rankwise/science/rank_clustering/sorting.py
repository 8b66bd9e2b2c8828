"""Sorting under noisy comparisons: PROBSORT (persistent random errors) and ADVSORT (adversarial-mu).

Both sort ``m`` items ``0 .. m-1`` through a vectorised comparator ``le(i, j) -> bool array`` that
answers "item i <= item j?" for integer arrays ``i``, ``j`` (for edges: one oracle query, or one
ALG-TESTER majority vote).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["probsort", "advsort", "window_sort", "dislocation"]

Comparator = Callable[[np.ndarray, np.ndarray], np.ndarray]


_TRIU: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _triu(w: int) -> tuple[np.ndarray, np.ndarray]:
    if w not in _TRIU:
        _TRIU[w] = np.triu_indices(w, 1)
    return _TRIU[w]


class _PairMemo:
    """Answers of already-compared pairs inside one PROBSORT run. The oracle is persistent, so
    re-asking would return the same answer: the memo only saves queries (and makes every pair cost
    one query, as in the analysis). Dense int8 table for m <= 4096 items, a dict above."""

    def __init__(self, m: int, le: Comparator) -> None:
        self.m, self.le = m, le
        self.dense = np.zeros((m, m), dtype=np.int8) if m <= 4096 else None  # 0 unknown, 1 le, -1 gt
        self.sparse: dict[int, bool] = {}

    def pairs(self, I: np.ndarray, J: np.ndarray) -> np.ndarray:
        """``I[t] <= J[t]`` for item arrays with ``I != J``; each unknown pair is asked once."""
        I = np.asarray(I, dtype=np.int64)
        J = np.asarray(J, dtype=np.int64)
        if I.size == 0:
            return np.zeros(0, dtype=bool)
        lo, hi = np.minimum(I, J), np.maximum(I, J)
        if self.dense is not None:
            known = self.dense[lo, hi]
            need = known == 0
            if need.any():
                key = lo[need] * self.m + hi[need]
                uk, inv = np.unique(key, return_inverse=True)
                ans = self.le(uk // self.m, uk % self.m)
                self.dense[uk // self.m, uk % self.m] = np.where(ans, 1, -1)
                known[need] = np.where(ans[inv], 1, -1)  # `known` is a gathered copy
            lo_le_hi = known > 0
        else:
            keys = (lo * self.m + hi).tolist()
            vals = [self.sparse.get(k) for k in keys]
            miss = sorted({k for k, v in zip(keys, vals) if v is None})
            if miss:
                mk = np.asarray(miss, dtype=np.int64)
                ans = self.le(mk // self.m, mk % self.m)
                self.sparse.update(zip(miss, ans.tolist()))
                vals = [self.sparse[k] for k in keys]
            lo_le_hi = np.asarray(vals, dtype=bool)
        return np.where(I == lo, lo_le_hi, ~lo_le_hi)

    def wins(self, windows: list[np.ndarray]) -> list[np.ndarray]:
        """For each window (array of items), the number of window items each item is reported <= to;
        all windows' unknown pairs go to the comparator in one batch."""
        Is, Js, sizes = [], [], []
        for win in windows:
            ia, ib = _triu(win.size)
            Is.append(win[ia])
            Js.append(win[ib])
            sizes.append(ia.size)
        ans = self.pairs(np.concatenate(Is), np.concatenate(Js)) if Is else np.zeros(0, dtype=bool)
        out, off = [], 0
        for win, sz in zip(windows, sizes):
            a = ans[off:off + sz]
            off += sz
            ia, ib = _triu(win.size)
            w = np.bincount(ia, weights=a, minlength=win.size) + np.bincount(ib, weights=~a, minlength=win.size)
            out.append(w)
        return out


def window_sort(items: np.ndarray, memo: _PairMemo) -> np.ndarray:
    """Sort a small window by counting pairwise wins (ties kept in input order)."""
    if items.size <= 1:
        return items
    w = memo.wins([items])[0]
    return items[np.argsort(-w, kind="stable")]


def robust_reinsert(order: np.ndarray, memo: _PairMemo, halfwidth: int) -> np.ndarray:
    """Re-place every item by a noisy binary search over the current sequence in which each probe
    compares the item with the ``2 * halfwidth`` items around the probe position and follows the
    majority (comparisons with distinct items have independent persistent errors, so the majority is
    right w.h.p. whenever the item's true rank is farther than the window from the probe). All items
    are searched simultaneously; the new order sorts items by (found position, old position)."""
    m = order.size
    if m <= 2:
        return order
    lo = np.zeros(m, dtype=np.int64)
    hi = np.full(m, m, dtype=np.int64)
    offs = np.r_[np.arange(-halfwidth, 0), np.arange(1, halfwidth + 1)]
    while True:
        a = np.nonzero(lo < hi)[0]
        if a.size == 0:
            break
        mid = (lo[a] + hi[a]) // 2
        P = np.clip(mid[:, None] + offs[None, :], 0, m - 1)
        others = order[P]
        me = np.broadcast_to(order[a][:, None], P.shape)
        valid = others != me
        valid[:, 1:] &= P[:, 1:] != P[:, :-1]  # positions clipped at the borders count once
        ans = np.zeros(P.shape, dtype=bool)
        ans[valid] = memo.pairs(me[valid], others[valid])
        go_left = 2 * ans.sum(axis=1) > valid.sum(axis=1)
        hi[a] = np.where(go_left, mid, hi[a])
        lo[a] = np.where(go_left, lo[a], mid + 1)
    return order[np.lexsort((np.arange(m), lo))]


def probsort(m: int, le: Comparator, delta: int = 5, repair: bool = True) -> np.ndarray:
    """PROBSORT (Lemma 2.1, Geissmann et al.): the order of ``m`` items under persistent comparison errors.

    Implementable form of the spec: merge sort; blocks of at most ``6 delta`` items are sorted by
    counting pairwise wins; a merge repeatedly sorts the first ``3 delta`` items of both lists together
    and emits the best ``delta``. All merges of the recursion that are ready run side by side, so the
    comparator sees one batch per merge step. With exact comparisons the output is exactly sorted.
    ``repair`` (our addition, see the docs): the windowed merge alone lets an item with an unlucky
    run of persistent errors stay stuck in a merge buffer and end up hundreds of ranks away; a final
    :func:`robust_reinsert` pass with windows of ``2 ceil(2 ln m)`` items brings the maximum
    dislocation to O(log m) at phi < 1/4 (measured in the tests). O(m log m) comparisons in all;
    pairs already compared in this run are not asked again.
    """
    if m < 0 or delta < 1:
        raise ValueError(f"probsort needs m >= 0 and delta >= 1, got m={m}, delta={delta}")
    memo = _PairMemo(m, le)
    base = 6 * delta
    w = 3 * delta
    # recursion tree over arange(m): node = (start, end); children split at the middle
    nodes: list[tuple[int, int]] = []
    children: list[tuple[int, int] | None] = []

    def build(a: int, b: int) -> int:
        idx = len(nodes)
        nodes.append((a, b))
        children.append(None)
        if b - a > base:
            mid = a + (b - a) // 2
            l_ = build(a, mid)
            r_ = build(mid, b)
            children[idx] = (l_, r_)
        return idx

    if m == 0:
        return np.zeros(0, dtype=np.int64)
    build(0, m)
    result: dict[int, list[int]] = {}
    leaves = [i for i, c in enumerate(children) if c is None]
    wins = memo.wins([np.arange(*nodes[i], dtype=np.int64) for i in leaves])
    for i, wv in zip(leaves, wins):
        items = np.arange(*nodes[i], dtype=np.int64)
        result[i] = items[np.argsort(-wv, kind="stable")].tolist()
    pending = [i for i, c in enumerate(children) if c is not None]
    while pending:
        ready = [i for i in pending if all(ch in result for ch in children[i])]  # type: ignore[union-attr]
        pending = [i for i in pending if i not in set(ready)]
        # state per ready merge: [L, R, li, ri, lb, rb, out]
        states = []
        for i in ready:
            l_, r_ = children[i]  # type: ignore[misc]
            states.append([result[l_], result[r_], 0, 0, [], [], [], i])
        active = list(range(len(states)))
        while active:
            windows, owners = [], []
            still = []
            for s_i in active:
                L, R, li, ri, lb, rb, out, _ = states[s_i]
                if len(lb) < w and li < len(L):
                    take = w - len(lb)
                    lb.extend(L[li:li + take])
                    li += take
                if len(rb) < w and ri < len(R):
                    take = w - len(rb)
                    rb.extend(R[ri:ri + take])
                    ri += take
                states[s_i][2], states[s_i][3] = li, ri
                if not lb or not rb:
                    out.extend(lb + L[li:] + rb + R[ri:])
                    continue
                windows.append(np.asarray(lb + rb, dtype=np.int64))
                owners.append(s_i)
                still.append(s_i)
            if windows:
                for s_i, win, wv in zip(owners, windows, memo.wins(windows)):
                    emit = win[np.argsort(-wv, kind="stable")[:delta]].tolist()
                    st = states[s_i]
                    st[6].extend(emit)
                    es = set(emit)
                    st[4] = [x for x in st[4] if x not in es]
                    st[5] = [x for x in st[5] if x not in es]
            active = still
        for st in states:
            result[st[7]] = st[6]
    order = np.asarray(result[0], dtype=np.int64)
    if repair and m > base:
        order = robust_reinsert(order, memo, int(np.ceil(2.0 * np.log(m))))
    return order


def advsort(m: int, le: Comparator, rng: np.random.Generator) -> np.ndarray:
    """ADVSORT (Lemma 2.2): randomised quicksort driven by ``le``; returns the order of ``m`` items.

    Vectorised by levels: every open segment picks a uniform pivot, all its other items are compared
    with the pivot in one batch, and the segment is split stably into (<= pivot), pivot, (> pivot).
    With an adversarial-mu comparator the output is O(1)-approximately sorted; O(m log m) comparisons.
    """
    order = np.arange(m, dtype=np.int64)
    if m <= 1:
        return order
    seg = np.zeros(m, dtype=np.int64)  # segment id of each position
    starts = np.array([0])
    sizes = np.array([m])
    pos = np.arange(m)
    while True:
        open_seg = sizes > 1
        if not open_seg.any():
            break
        piv_pos = starts + np.minimum((rng.random(sizes.size) * sizes).astype(np.int64), sizes - 1)
        act = open_seg[seg]
        is_piv = np.zeros(m, dtype=bool)
        is_piv[piv_pos[open_seg]] = True
        cmp_pos = pos[act & ~is_piv]
        le_piv = np.zeros(m, dtype=bool)
        if cmp_pos.size:
            le_piv[cmp_pos] = le(order[cmp_pos], order[piv_pos[seg[cmp_pos]]])
        # group 0: <= pivot (and every item of a closed segment), 1: the pivot, 2: > pivot
        group = np.where(is_piv, 1, np.where(act & ~le_piv, 2, 0))
        perm = np.lexsort((pos, group, seg))
        order, group, seg_old = order[perm], group[perm], seg[perm]
        key = seg_old * 3 + group
        change = np.r_[True, key[1:] != key[:-1]]
        seg = np.cumsum(change) - 1
        starts = np.nonzero(change)[0]
        sizes = np.diff(np.r_[starts, m])
    return order


def dislocation(order: np.ndarray, true_rank: np.ndarray) -> np.ndarray:
    """``|position in order - true rank|`` per item (``order``: item ids by position)."""
    pos = np.empty(order.size, dtype=np.int64)
    pos[order] = np.arange(order.size)
    return np.abs(pos - np.asarray(true_rank))
