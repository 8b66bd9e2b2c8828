"""Candidate mining (spec steps 2-5): structural induction, token-level BPE on content, VEGAD ranking, and
the reachability filter.

* Structural (step 3): the structural runs of every rendered trajectory (maximal stretches of structural
  segments, cut at the template markers and after every line break) are split into *atoms* (a run of word characters, a run of
  white space, or one punctuation character). Every atom n-gram of at most ``max_chars`` characters is
  counted over the corpus; the closed ones (no one-atom extension is as frequent: the greedy growth stops
  where contexts diverge) seen at least ``min_freq`` times are candidates, scored by
  ``freq(u) * (len_T0(u) - 1)``, the decoding steps they would save. Counting runs over distinct runs
  weighted by their multiplicity, so it costs the number of distinct structures, not the corpus size.
* Content (step 4a, "TL-BPE"): each content run is encoded by T0; the id sequences are written with one
  private-use character per id and a byte-pair-encoding trainer (Hugging Face ``tokenizers``,
  ``max_token_length=max_subwords``, ``min_frequency=min_freq``) learns merges over them; every merged
  symbol of 2..``max_subwords`` base ids is a candidate (its text: T0's decoding of the ids).
* VEGAD (step 4b): the SFT loss of a model on a sample of rendered sequences is back-propagated to the
  input embeddings; a content candidate's score is the sum, over its occurrences in the T0 encodings
  (found by looking up every window of 2..``max_subwords`` ids), of the L2 norms of the gradients at the
  positions it covers (a choice: the paper's exact accumulation is not published).
* Reachability (step 5): all candidates are added to a copy of T0, the corpus is re-encoded, and only the
  candidates the tokenizer emits stay; the top ``K`` of each stream by score are mixed, and the filter is
  repeated on the final list until every kept token is emitted.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from rankwise.infer.agentvocab.template import MARKERS, Rendered

__all__ = ["Candidate", "content_runs", "is_marker_safe", "mine_content", "mine_structural",
           "select_reachable", "structural_runs", "token_counts", "vegad_scores"]

_ATOM = re.compile(r"\w+|\s+|[^\w\s]")
_LINE = re.compile(r"(?<=\n)")  # structural candidates do not cross a line break (one may end them)


@dataclass
class Candidate:
    """A mined string: its ``stream`` (``"structural"`` or ``"content"``), ``score`` (higher first), corpus
    frequency in its stream and ``base_ids`` (its T0 encoding)."""

    text: str
    stream: str
    score: float
    freq: int
    base_ids: tuple[int, ...]


def is_marker_safe(text: str, markers: Sequence[str] = MARKERS) -> bool:
    """False when ``text`` contains a marker or overlaps one at either end (would split it)."""
    if not any(m[0] in text or m[-1] in text for m in markers):  # fast path: no marker edge character
        return True
    for m in markers:
        if m in text:
            return False
        for k in range(1, len(m)):
            if text.endswith(m[:k]) or text.startswith(m[-k:]):
                return False
    return True


def _runs(rendered: Iterable[Rendered], kind: str, markers: Sequence[str]) -> Counter[str]:
    cut = re.compile("|".join(re.escape(m) for m in markers)) if markers else None
    runs: Counter[str] = Counter()
    for r in rendered:
        buf: list[str] = []
        for seg in [*r.segments, None]:
            if seg is not None and seg.kind == kind:
                buf.append(seg.text)
                continue
            if buf:
                text = "".join(buf)
                for piece in (cut.split(text) if cut else [text]):
                    if piece:
                        runs[piece] += 1
                buf = []
    return runs


def structural_runs(rendered: Iterable[Rendered], markers: Sequence[str] = MARKERS) -> Counter[str]:
    """Distinct maximal structural runs (cut at the markers) with their counts."""
    return _runs(rendered, "s", markers)


def content_runs(rendered: Iterable[Rendered]) -> Counter[str]:
    """Distinct maximal content runs with their counts."""
    return _runs(rendered, "c", ())


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Ids of each text (no special tokens), through the Rust tokenizer when there is one (fast for many)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _dominated(lines: Counter[str], counts: Counter[str], max_chars: int) -> set[str]:
    """N-grams that always continue with the same atom on one side (an extension by one atom has the same
    frequency): the longer one saves at least as many steps, so only closed n-grams stay candidates."""
    out: set[str] = set()
    for line in lines:
        ends = [m.end() for m in _ATOM.finditer(line)]
        starts = [0, *ends[:-1]]
        for i, a in enumerate(starts):  # right extensions
            prev = None
            for b in ends[i:]:
                if b - a > max_chars:
                    break
                u = line[a:b]
                if prev is not None and counts[u] == counts[prev]:
                    out.add(prev)
                prev = u
        for j, b in enumerate(ends):  # left extensions
            prev = None
            for a in reversed(starts[:j + 1]):
                if b - a > max_chars:
                    break
                u = line[a:b]
                if prev is not None and counts[u] == counts[prev]:
                    out.add(prev)
                prev = u
    return out


def mine_structural(rendered: Sequence[Rendered], tokenizer: Any, *, min_freq: int = 10,
                    max_candidates: int = 10_000, max_chars: int = 64,
                    markers: Sequence[str] = MARKERS) -> list[Candidate]:
    """Structural candidates, best score first (module docstring)."""
    lines: Counter[str] = Counter()
    for run, w in structural_runs(rendered, markers).items():
        for line in _LINE.split(run):
            if line:
                lines[line] += w
    counts: Counter[str] = Counter()
    for line, w in lines.items():
        ends = [m.end() for m in _ATOM.finditer(line)]
        starts = [0, *ends[:-1]]
        for i, a in enumerate(starts):
            for b in ends[i:]:
                if b - a > max_chars:
                    break
                counts[line[a:b]] += w
    dominated = _dominated(lines, counts, max_chars)
    texts = [s for s, f in counts.items()
             if f >= min_freq and s not in dominated and is_marker_safe(s, markers)]
    out = []
    for s, ids in zip(texts, _encode(tokenizer, texts)):
        if len(ids) >= 2:
            out.append(Candidate(s, "structural", float(counts[s] * (len(ids) - 1)), counts[s], tuple(ids)))
    out.sort(key=lambda c: (-c.score, c.text))
    return out[:max_candidates]


def _private(i: int) -> str:
    return chr(0xF0000 + i) if i < 0xFFFE else chr(0x100000 + i - 0xFFFE)


def mine_content(rendered: Sequence[Rendered], tokenizer: Any, *, min_freq: int = 10, max_subwords: int = 4,
                 max_candidates: int = 10_000, markers: Sequence[str] = MARKERS) -> list[Candidate]:
    """Content candidates from token-level BPE (module docstring), ordered by frequency x steps saved
    (:func:`vegad_scores` re-scores them)."""
    from tokenizers import Tokenizer, models, trainers

    runs = content_runs(rendered)
    texts = list(runs)
    seqs = _encode(tokenizer, texts)
    dense: dict[int, int] = {}
    words = []
    for seq in seqs:
        words.append("".join(_private(dense.setdefault(i, len(dense))) for i in seq))
    if not dense:
        return []
    back = {_private(d): i for i, d in dense.items()}
    bpe = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=len(dense) + max_candidates, min_frequency=min_freq,
                                  max_token_length=max_subwords, initial_alphabet=list(back), show_progress=False)
    bpe.train_from_iterator((w for w, text in zip(words, texts) for _ in range(runs[text]) if len(w) >= 2),
                            trainer=trainer)
    merged = [tuple(back[ch] for ch in sym) for sym in bpe.get_vocab() if len(sym) >= 2 and all(ch in back for ch in sym)]
    freq: Counter[tuple[int, ...]] = Counter()
    wanted = set(merged)
    for seq, text in zip(seqs, texts):
        for n in range(2, max_subwords + 1):
            for p in range(len(seq) - n + 1):
                key = tuple(seq[p:p + n])
                if key in wanted:
                    freq[key] += runs[text]
    out = []
    for ids in merged:
        text = tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)
        if not text or "\ufffd" in text or not is_marker_safe(text, markers) or freq[ids] < min_freq:
            continue
        out.append(Candidate(text, "content", float(freq[ids] * (len(ids) - 1)), freq[ids], ids))
    # distinct texts only (two id sequences may decode to the same string): keep the better one
    best: dict[str, Candidate] = {}
    for c in out:
        if c.text not in best or c.score > best[c.text].score:
            best[c.text] = c
    single = {c.text for c, ids in zip(best.values(), _encode(tokenizer, list(best))) if len(ids) < 2}
    final = [c for c in best.values() if c.text not in single]
    final.sort(key=lambda c: (-c.score, c.text))
    return final[:max_candidates]


def vegad_scores(model: torch.nn.Module, tokenizer: Any, sample: Sequence[Rendered], candidates: list[Candidate],
                 *, max_length: int = 4096) -> list[Candidate]:
    """Re-score content candidates by embedding-gradient magnitude (module docstring); returns them sorted
    (ties by the frequency score). The model's parameters and mode are left as they were."""
    from rankwise.infer.agentvocab.train import sft_example

    index: dict[tuple[int, ...], int] = {c.base_ids: i for i, c in enumerate(candidates)}
    lens = sorted({len(k) for k in index})
    score = [0.0] * len(candidates)
    emb = model.get_input_embeddings()
    was_training = model.training
    model.eval()
    try:
        for r in sample:
            ids, labels = sft_example(tokenizer, r, max_length)
            if not (labels != -100).any():
                continue
            x = emb(ids[None]).detach().requires_grad_(True)
            out = model(inputs_embeds=x, labels=labels[None])
            (grad,) = torch.autograd.grad(out.loss, x)
            g = grad[0].norm(dim=-1).tolist()
            seq = ids.tolist()
            for n in lens:
                for p in range(len(seq) - n + 1):
                    i = index.get(tuple(seq[p:p + n]))
                    if i is not None:
                        score[i] += sum(g[p:p + n])
    finally:
        model.train(was_training)
    freq_score = {id(c): c.score for c in candidates}
    ranked = [Candidate(c.text, c.stream, s, c.freq, c.base_ids) for c, s in zip(candidates, score)]
    order = sorted(range(len(ranked)), key=lambda i: (-ranked[i].score, -freq_score[id(candidates[i])],
                                                         ranked[i].text))
    return [ranked[i] for i in order]


def token_counts(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Tokens of each text (no special tokens added)."""
    return [len(ids) for ids in _encode(tokenizer, list(texts))]


def _emitted(tokenizer: Any, tokens: Sequence[str], texts: Sequence[str]) -> list[int]:
    """How often each of ``tokens``, added to a copy of ``tokenizer``'s Rust tokenizer (the transformers
    wrapper is slow to add thousands), is emitted when ``texts`` are encoded."""
    from tokenizers import AddedToken, Tokenizer

    raw = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    raw.add_tokens([AddedToken(t, normalized=False, special=False) for t in tokens])
    ids = [raw.token_to_id(t) for t in tokens]
    seen: Counter[int] = Counter()
    for enc in raw.encode_batch(list(texts), add_special_tokens=False):
        seen.update(enc.ids)
    return [seen[i] for i in ids]


def select_reachable(structural: Sequence[Candidate], content: Sequence[Candidate], tokenizer: Any,
                     texts: Sequence[str], *, structural_budget: int, content_budget: int,
                     max_rounds: int = 5) -> list[Candidate]:
    """The reachability filter and the mix (spec steps 5-6): structural first, then content.

    Every candidate (structural ones first, a content string already structural is dropped) is added to a
    copy of ``tokenizer``; ``texts`` are re-encoded and unemitted candidates are dropped; the top
    ``structural_budget`` / ``content_budget`` of each stream by score are kept, and the check is repeated
    on the kept list (a token reachable only next to a dropped one goes) for up to ``max_rounds`` rounds.
    Warns when a stream has fewer reachable candidates than its budget (all of them are used)."""
    if structural_budget + content_budget == 0:
        return []
    taken = {c.text for c in structural}
    pools = {"structural": list(structural), "content": [c for c in content if c.text not in taken]}
    budgets = {"structural": structural_budget, "content": content_budget}
    alive = [c for k in ("structural", "content") if budgets[k] > 0 for c in pools[k]]
    if not alive:
        return []
    for _ in range(max_rounds + 1):
        seen = _emitted(tokenizer, [c.text for c in alive], texts)
        reached = [c for c, n in zip(alive, seen) if n > 0]
        chosen = []
        for k in ("structural", "content"):
            chosen += sorted((c for c in reached if c.stream == k), key=lambda c: -c.score)[:budgets[k]]
        if len(chosen) == len(alive):
            break
        alive = chosen
    for k in ("structural", "content"):
        n = sum(c.stream == k for c in alive)
        if n < budgets[k]:
            warnings.warn(f"{k} budget {budgets[k]} is larger than the {n} reachable {k} candidates; using all "
                          f"{n}", stacklevel=3)
    return alive
