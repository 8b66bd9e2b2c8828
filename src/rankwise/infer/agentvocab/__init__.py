"""AgentVocab (ICML 2026): structure-aware vocabulary adaptation from tool-calling traces.

Mine recurring structural fragments (template tags, JSON scaffolding, call signatures) and frequent
content fragments (token-level BPE, ranked by embedding gradients) from rendered agent traces, keep the
ones the tokenizer actually emits, add them as tokens with mean-initialised rows and fine-tune. Public face:

* :class:`AgentVocabConfig`, :class:`AgentVocab` (``render``, ``mine``, ``select_reachable``, ``expand``,
  ``compression_report``), :class:`CompressionReport`;
* the template: :func:`render`, :func:`render_corpus`, :func:`parse_call`, :func:`parse_calls`,
  :func:`exact_match`, :func:`call_text`, :data:`MARKERS`;
* pieces: :func:`mine_structural`, :func:`mine_content`, :func:`vegad_scores`, :func:`select_reachable`,
  :func:`expanded_tokenizer`, :func:`expand_model`, :func:`add_markers`, :func:`continued_bpe` (contrast);
* training and decoding: :func:`sft_train`, :func:`generate_calls`, :func:`timed_call`.

docs/methods/agentvocab.md records the choices the paper leaves open.
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.infer.agentvocab.config import AgentVocabConfig
from rankwise.infer.agentvocab.expand import add_markers, expand_model, expanded_tokenizer, subtoken_ids
from rankwise.infer.agentvocab.method import AgentVocab, CompressionReport, compression_report, continued_bpe
from rankwise.infer.agentvocab.mining import (
    Candidate,
    is_marker_safe,
    mine_content,
    mine_structural,
    select_reachable,
    token_counts,
    vegad_scores,
)
from rankwise.infer.agentvocab.template import (
    MARKERS,
    Rendered,
    Segment,
    call_text,
    exact_match,
    parse_call,
    parse_calls,
    render,
    render_corpus,
)
from rankwise.infer.agentvocab.train import Decoded, generate_calls, sft_example, sft_train, timed_call

__all__ = [
    "MARKERS",
    "AgentVocab",
    "AgentVocabConfig",
    "Candidate",
    "CompressionReport",
    "Decoded",
    "Rendered",
    "Segment",
    "add_markers",
    "call_text",
    "compression_report",
    "continued_bpe",
    "exact_match",
    "expand_model",
    "expanded_tokenizer",
    "generate_calls",
    "is_marker_safe",
    "mine_content",
    "mine_structural",
    "parse_call",
    "parse_calls",
    "render",
    "render_corpus",
    "select_reachable",
    "sft_example",
    "sft_train",
    "subtoken_ids",
    "timed_call",
    "token_counts",
    "vegad_scores",
]


def _entry(tokenizer: object, config: AgentVocabConfig | None = None) -> AgentVocab:
    return AgentVocab(tokenizer, config)


register("agentvocab", config=AgentVocabConfig, entry=_entry)
