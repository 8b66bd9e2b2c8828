"""The hermes-like agent template, the structural/content split and the tool-call parser.

A trajectory is ``{"tools": [schema, ...], "messages": [...]}`` (roles ``user``, ``assistant`` with
``content`` or ``tool_calls=[{"name", "arguments"}]``, ``tool`` with ``content``), the format of
:mod:`rankwise.zoo.agent_traces` and of ms-swift's agent data. :func:`render` turns it into the exact
string the tokenizer sees at training time::

    <|im_start|>system
    Tools are listed below, one JSON schema per line. Call one by writing a JSON object ...
    <tools>
    {"name": ..., "description": ..., "parameters": {...}}
    </tools><|im_end|>
    <|im_start|>user
    ...<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {"status": "ok", ...}
    </tool_response><|im_end|>
    <|im_start|>assistant
    ...<|im_end|>

together with *segments*: the same text cut into pieces labelled structural (``"s"``: template tags, role
lines, JSON punctuation and whitespace, object keys, function names, schema keywords and enum values) or
content (``"c"``: JSON string values other than names and schema keywords, numbers, booleans, natural
language), and flagged ``train`` where the assistant writes them (the SFT loss positions). The split rule
is a choice (the paper does not publish its own).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["MARKERS", "Rendered", "Segment", "call_text", "exact_match", "parse_call", "parse_calls", "render",
           "render_corpus"]

#: the template's markers: whole tokens in a chat tokenizer; no mined candidate may contain or split one
MARKERS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<tools>", "</tools>", "<tool_call>", "</tool_call>",
                            "<tool_response>", "</tool_response>")

_SYSTEM = ("Tools are listed below, one JSON schema per line. Call one by writing a JSON object with the keys "
           "name and arguments between <tool_call></tool_call> tags.\n")


@dataclass(frozen=True)
class Segment:
    text: str
    kind: str  # "s" structural, "c" content
    train: bool = False  # written by the assistant (carries the SFT loss)


@dataclass
class Rendered:
    """A rendered trajectory: ``text`` (= the segments joined), ``prompt`` (the text up to the first
    assistant turn, what a model is given at evaluation), ``call`` (the gold first call) and ``index`` (the
    record's position in the input)."""

    text: str
    segments: list[Segment]
    prompt: str
    call: dict[str, Any]
    index: int = 0
    train_spans: list[tuple[int, int]] = field(default_factory=list)


class _Builder:
    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.train = False

    def add(self, text: str, kind: str) -> None:
        if text:
            self.segments.append(Segment(text, kind, self.train))

    def json(self, obj: Any, content_keys: frozenset[str] = frozenset(), keyword: bool = False) -> None:
        """``json.dumps(obj)`` as segments: keys and punctuation structural; a string value structural when
        ``keyword`` (schema parts, function names), else content; numbers and booleans content."""
        if isinstance(obj, dict):
            self.add("{", "s")
            for i, (k, v) in enumerate(obj.items()):
                self.add((", " if i else "") + json.dumps(k) + ": ", "s")
                if k == "name" and isinstance(v, str):
                    self.json(v, keyword=True)
                else:
                    self.json(v, content_keys, keyword and k not in content_keys)
            self.add("}", "s")
        elif isinstance(obj, list):
            self.add("[", "s")
            for i, v in enumerate(obj):
                if i:
                    self.add(", ", "s")
                self.json(v, content_keys, keyword)
            self.add("]", "s")
        elif isinstance(obj, str):
            quoted = json.dumps(obj)
            self.add('"', "s")
            self.add(quoted[1:-1], "s" if keyword else "c")
            self.add('"', "s")
        else:
            self.add(json.dumps(obj), "c")


    def tool_output(self, text: str) -> None:
        """A tool's output: its JSON keys and punctuation structural, its values content (plain text: content)."""
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, (dict, list)) and json.dumps(obj) == text:
            self.json(obj)
        else:
            self.add(text, "c")


def call_text(call: dict[str, Any]) -> str:
    """The assistant's call block for ``call`` (``<tool_call>\\n{json}\\n</tool_call>``)."""
    return "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n</tool_call>"


def _check_record(rec: Any) -> dict[str, Any]:
    """The first call of a valid record; raises ``_Invalid`` otherwise."""
    if not isinstance(rec, dict) or not isinstance(rec.get("tools"), list) or not isinstance(rec.get("messages"), list):
        raise _Invalid("not a {tools: [...], messages: [...]} object")
    names = set()
    for t in rec["tools"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _Invalid("a tool has no name")
        names.add(t["name"])
    first = None
    for m in rec["messages"]:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "tool"):
            raise _Invalid("a message has no valid role")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not calls:
                raise _Invalid("tool_calls is not a non-empty list")
            for c in calls:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("arguments"), dict):
                    raise _Invalid("a call lacks a name or an arguments object")
                if c["name"] not in names:
                    raise _Invalid(f"call to {c['name']!r}, which is not among the record's tools")
                try:
                    json.dumps(c["arguments"], allow_nan=False)
                except (TypeError, ValueError) as e:
                    raise _Invalid(f"arguments are not JSON ({e})") from e
            first = first or calls[0]
        elif not isinstance(m.get("content"), str):
            raise _Invalid(f"a {m.get('role')} message has no text content")
    if first is None:
        raise _Invalid("no tool call")
    return first


class _Invalid(ValueError):
    pass


def render(rec: dict[str, Any], index: int = 0) -> Rendered:
    """Render one trajectory (module docstring); raises ValueError if it is invalid or not UTF-8 encodable."""
    try:
        call = _check_record(rec)
    except _Invalid as e:
        raise ValueError(f"record {index}: {e}") from None
    b = _Builder()
    b.add("<|im_start|>system\n" + _SYSTEM + "<tools>\n", "s")
    for t in rec["tools"]:
        b.json(t, content_keys=frozenset({"description"}), keyword=True)
        b.add("\n", "s")
    b.add("</tools><|im_end|>\n", "s")
    prompt = None
    for m in rec["messages"]:
        role = m["role"]
        if role == "tool":
            b.add("<|im_start|>user\n<tool_response>\n", "s")
            b.tool_output(m["content"])
            b.add("\n</tool_response><|im_end|>\n", "s")
            continue
        b.add(f"<|im_start|>{role}\n", "s")
        if role == "assistant":
            if prompt is None:
                prompt = "".join(s.text for s in b.segments)
            b.train = True
        if m.get("tool_calls"):
            for i, c in enumerate(m["tool_calls"]):
                b.add(("\n" if i else "") + "<tool_call>\n", "s")
                b.json({"name": c["name"], "arguments": c["arguments"]})
                b.add("\n</tool_call>", "s")
        else:
            b.add(m["content"], "c")
        b.add("<|im_end|>", "s")
        b.train = False
        b.add("\n", "s")
    text = "".join(s.text for s in b.segments)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"record {index}: text is not valid UTF-8 ({e.reason} at character {e.start})") from None
    spans, pos = [], 0
    for s in b.segments:
        if s.train:
            if spans and spans[-1][1] == pos:
                spans[-1] = (spans[-1][0], pos + len(s.text))
            else:
                spans.append((pos, pos + len(s.text)))
        pos += len(s.text)
    return Rendered(text, b.segments, prompt or text, dict(call), index, spans)


def render_corpus(records: Sequence[Any]) -> tuple[list[Rendered], list[str]]:
    """Render every valid record; returns ``(rendered, reasons the others were rejected)``.

    Raises ValueError when nothing is left (naming how many records were rejected and the first reason),
    and at once for a record whose text is not UTF-8 encodable (naming the record)."""
    out, rejected = [], []
    for i, rec in enumerate(records):
        try:
            out.append(render(rec, i))
        except ValueError as e:
            if "UTF-8" in str(e):
                raise
            rejected.append(str(e))
    if not out:
        first = f" (first: {rejected[0]})" if rejected else ""
        raise ValueError(f"no trajectory with a parsable tool call: {len(rejected)} of {len(records)} records "
                         f"rejected{first}")
    return out, rejected


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str) -> list[dict[str, Any]]:
    """Every well-formed call in decoded model output: the JSON objects between ``<tool_call>`` tags that
    have a string ``name`` and an object ``arguments`` (others are skipped). An unterminated last block
    counts when its JSON is complete."""
    blocks = _CALL.findall(text)
    tail = text.rsplit("<tool_call>", 1)
    if len(tail) == 2 and "</tool_call>" not in tail[1]:
        blocks.append(tail[1].strip())
    out = []
    for b in blocks:
        try:
            obj = json.loads(b)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
            out.append({"name": obj["name"], "arguments": obj["arguments"]})
    return out


def parse_call(text: str) -> dict[str, Any] | None:
    """The first well-formed call of ``text`` (:func:`parse_calls`), or None."""
    calls = parse_calls(text)
    return calls[0] if calls else None


def exact_match(predicted: dict[str, Any] | None, gold: dict[str, Any]) -> bool:
    """Name and arguments equal as JSON (types included: ``1`` is not ``1.0`` nor ``true``)."""
    if predicted is None:
        return False
    canon = lambda c: json.dumps({"name": c["name"], "arguments": c["arguments"]}, sort_keys=True)  # noqa: E731
    return canon(predicted) == canon(gold)
