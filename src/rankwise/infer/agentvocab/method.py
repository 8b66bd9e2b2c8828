"""The AgentVocab pipeline object and the continued-BPE contrast.

::

    av = AgentVocab(tokenizer, AgentVocabConfig(structural_budget=96, content_budget=32))
    rendered = av.render(trajectories)                 # exact training-time strings (invalid records dropped)
    cands = av.mine(rendered, grad_model=stage1)       # {"structural": [...], "content": [...]}, scored
    tokens = av.select_reachable(cands, rendered)      # reachability filter, top-K per stream, mixed
    new_tok, model = av.expand(model, tokens)          # added tokens + mean-initialised rows
    report = av.compression_report(rendered, new_tok)  # prompt / call / total tokens before vs after

``tokenizer`` is T0 with the template markers as single tokens (:func:`add_markers` makes them so for a
tokenizer that lacks them). :func:`continued_bpe` is the contrast: the same number of new tokens learned as
ordinary BPE merges appended after T0's merges (so they apply inside pre-tokenized words only).
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from rankwise.infer.agentvocab.config import AgentVocabConfig
from rankwise.infer.agentvocab.expand import expand_model, expanded_tokenizer
from rankwise.infer.agentvocab.mining import (
    Candidate,
    mine_content,
    mine_structural,
    select_reachable,
    token_counts,
    vegad_scores,
)
from rankwise.infer.agentvocab.template import MARKERS, Rendered, call_text, render_corpus

__all__ = ["AgentVocab", "CompressionReport", "compression_report", "continued_bpe"]


@dataclass
class CompressionReport:
    """Mean tokens per trajectory before (T0) and after (the expanded tokenizer) and their reductions."""

    n: int
    prompt_before: float
    prompt_after: float
    call_before: float
    call_after: float
    total_before: float
    total_after: float
    new_tokens: int

    def reduction(self, what: str) -> float:
        """``1 - after / before`` of ``what`` in ``prompt``, ``call``, ``total``."""
        before = getattr(self, f"{what}_before")
        return 1.0 - getattr(self, f"{what}_after") / before if before else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update({f"{w}_reduction": self.reduction(w) for w in ("prompt", "call", "total")})
        return d

    def lines(self) -> list[str]:
        out = [f"{self.n} trajectories, {self.new_tokens} new tokens; mean tokens per trajectory (before -> after):"]
        for w in ("prompt", "call", "total"):
            out.append(f"  {w:<6} {getattr(self, f'{w}_before'):9.1f} -> {getattr(self, f'{w}_after'):9.1f}"
                       f"  ({100 * self.reduction(w):5.1f} % fewer)")
        return out


def _mean(xs: Sequence[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def compression_report(rendered: Sequence[Rendered], before: Any, after: Any) -> CompressionReport:
    """Tokens of the prompts, of the gold first calls and of the whole texts under both tokenizers."""
    def counts(tok: Any) -> tuple[list[int], list[int], list[int]]:
        return (token_counts(tok, [r.prompt for r in rendered]), token_counts(tok, [call_text(r.call) for r in rendered]),
                token_counts(tok, [r.text for r in rendered]))

    b, a = counts(before), counts(after)
    return CompressionReport(len(rendered), _mean(b[0]), _mean(a[0]), _mean(b[1]), _mean(a[1]), _mean(b[2]),
                             _mean(a[2]), len(after) - len(before))


class AgentVocab:
    """Structure-aware vocabulary adaptation of ``tokenizer`` (T0) for agent traces (module docstring)."""

    def __init__(self, tokenizer: Any, config: AgentVocabConfig | None = None, markers: Sequence[str] = MARKERS):
        self.tokenizer = tokenizer
        self.config = config or AgentVocabConfig()
        self.markers = tuple(markers)
        self.rejected: list[str] = []

    def render(self, trajectories: Sequence[Any], template: str | None = None) -> list[Rendered]:
        """Render the valid trajectories (invalid ones are dropped; :attr:`rejected` says why)."""
        if (template or self.config.template) != "hermes":
            raise ValueError(f"template must be 'hermes', got {template!r}")
        rendered, self.rejected = render_corpus(trajectories)
        return rendered

    def mine(self, rendered: Sequence[Rendered], grad_model: torch.nn.Module | None = None,
             grad_sample: Sequence[Rendered] | None = None) -> dict[str, list[Candidate]]:
        """Scored candidates of both streams. With ``grad_model``, content candidates are ranked by VEGAD
        gradients on ``grad_sample`` (default: the first ``grad_samples`` rendered sequences); without, by
        frequency x subwords saved."""
        cfg = self.config
        if not rendered:
            raise ValueError("mine() needs at least one rendered trajectory")
        structural = mine_structural(rendered, self.tokenizer, min_freq=cfg.min_freq, max_candidates=cfg.max_candidates,
                                     max_chars=cfg.max_structural_chars, markers=self.markers)
        content = mine_content(rendered, self.tokenizer, min_freq=cfg.min_freq, max_subwords=cfg.max_subwords,
                               max_candidates=cfg.max_candidates, markers=self.markers)
        if grad_model is not None and content and cfg.grad_samples > 0:
            sample = list(grad_sample) if grad_sample is not None else list(rendered[:cfg.grad_samples])
            content = vegad_scores(grad_model, self.tokenizer, sample, content, max_length=cfg.grad_max_length)
        return {"structural": structural, "content": content}

    def select_reachable(self, candidates: dict[str, list[Candidate]], rendered: Sequence[Rendered],
                         structural_budget: int | None = None, content_budget: int | None = None) -> list[Candidate]:
        """Reachable top-K of each stream, mixed (structural first); budgets default to the config's."""
        sb = self.config.structural_budget if structural_budget is None else structural_budget
        cb = self.config.content_budget if content_budget is None else content_budget
        for name, b in (("structural_budget", sb), ("content_budget", cb)):
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise ValueError(f"AgentVocab.select_reachable: {name} must be an int >= 0, got {b!r}")
        return select_reachable(candidates.get("structural", []), candidates.get("content", []), self.tokenizer,
                                [r.text for r in rendered], structural_budget=sb, content_budget=cb)

    def expand(self, model: torch.nn.Module | None, tokens: Sequence[Candidate | str]) -> tuple[Any, torch.nn.Module | None]:
        """The expanded tokenizer, and ``model`` (in place) with rows for the new ids (``config.init``)."""
        texts = [t.text if isinstance(t, Candidate) else t for t in tokens]
        new = expanded_tokenizer(self.tokenizer, texts)
        if model is not None:
            expand_model(model, self.tokenizer, texts, init=self.config.init)
        return new, model

    def compression_report(self, rendered: Sequence[Rendered], expanded: Any) -> CompressionReport:
        return compression_report(rendered, self.tokenizer, expanded)


def _added_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    added = sorted((t for t in tokenizer.get_added_vocab()), key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in added)) if added else None


def continued_bpe(tokenizer: Any, texts: Sequence[str], budget: int, min_freq: int = 2) -> tuple[Any, list[str]]:
    """Continued BPE (the contrast): ``budget`` merges learned on ``texts`` over T0's own tokens inside
    T0's pre-tokenized words, appended after T0's merges. Returns ``(tokenizer, new token texts)``; the new
    model-vocabulary ids are ``len(tokenizer)..`` (mean-initialise them with :func:`expand_model` on the
    returned texts)."""
    from tokenizers import Tokenizer, models, trainers

    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    backend = tokenizer.backend_tokenizer
    cut = _added_pattern(tokenizer)
    words: Counter[str] = Counter()
    for text in texts:
        for piece in (cut.split(text) if cut else [text]):
            if piece:
                words.update(w for w, _ in backend.pre_tokenizer.pre_tokenize_str(piece))
    symbols: dict[str, str] = {}
    seqs = {}
    for w in words:
        toks = [t.value for t in backend.model.tokenize(w)]
        seqs[w] = "".join(symbols.setdefault(t, chr(0xF0000 + len(symbols))) for t in toks)
    if budget == 0 or not symbols:
        return copy.deepcopy(tokenizer), []
    back = {c: t for t, c in symbols.items()}
    bpe = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=len(symbols) + 3 * budget, min_frequency=min_freq,
                                  initial_alphabet=list(back), show_progress=False)
    bpe.train_from_iterator((seqs[w] for w, n in words.items() for _ in range(n) if len(seqs[w]) >= 2), trainer=trainer)
    merges = json.loads(bpe.to_str())["model"]["merges"]
    tj = json.loads(backend.to_str())
    vocab = tj["model"]["vocab"]
    for t in tj.get("added_tokens", []):  # keep the model vocabulary contiguous so that no added id moves
        vocab.setdefault(t["content"], t["id"])
    if sorted(vocab.values()) != list(range(len(vocab))) or len(vocab) != len(tokenizer):
        raise ValueError("continued_bpe: the tokenizer's ids are not contiguous; cannot append merges")
    known = set(vocab)
    new_tokens, next_id = [], len(tokenizer)
    for m in merges:
        left, right = m if isinstance(m, list) else m.split(" ")
        lt, rt = "".join(back[c] for c in left), "".join(back[c] for c in right)
        if lt + rt in known:
            continue
        vocab[lt + rt] = next_id
        tj["model"]["merges"].append([lt, rt])
        known.add(lt + rt)
        new_tokens.append(lt + rt)
        next_id += 1
        if len(new_tokens) == budget:
            break
    new = copy.deepcopy(tokenizer)
    new._tokenizer = Tokenizer.from_str(json.dumps(tj))
    texts_out = [backend.decoder.decode([t]) for t in new_tokens]
    return new, texts_out
