"""A user's text files and tokenised text batches: what the commands read when given ``--calib FILE``.

:func:`read_texts` reads ``.txt`` (one text per non-empty line) or ``.jsonl`` / ``.ndjson`` (one JSON
string, or an object with a ``"text"`` string field, per line); :func:`tokenize_batches` turns texts
into padded ``{"input_ids", "attention_mask"}`` batches with any Hugging Face tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from rankwise.core.validate import check_int

if TYPE_CHECKING:  # torch only where batches are built, so that reading JSONL (the CLI) stays light
    import torch

__all__ = ["iter_jsonl", "json_line", "read_texts", "tokenize_batches"]


def json_line(path: Path, no: int, line: str) -> Any:
    """Line ``no`` of a JSON-lines file, parsed; ``ValueError("<path>:<no>: not valid JSON (...)")`` if it is not."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{no}: not valid JSON ({e.msg})") from None


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` for every non-blank line of a JSON-lines file.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError("<path>:<no>: ...")`` for a line
    that is not UTF-8 or not valid JSON. Checking the values' shape is the caller's.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    with path.open("rb") as fh:
        for no, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{no}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
                                 ) from None
            if line.strip():
                yield no, json_line(path, no, line)


def read_texts(path: str | Path) -> list[str]:
    """Texts of a ``.jsonl`` file (a JSON string or ``{"text": ...}`` per line) or a plain text file (one per line).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file (and the line)
    for text that is not UTF-8, a line that is not valid JSON or has no text, or a file without text.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = p.read_bytes()[:e.start].count(b"\n") + 1
        raise ValueError(f"{p}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out: list[str] = []
    if p.suffix.lower() in (".jsonl", ".ndjson"):
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            obj = json_line(p, i, line)
            text = obj.get("text") if isinstance(obj, dict) else obj
            if not isinstance(text, str):
                raise ValueError(f"{p}:{i}: expected a JSON string or an object with a 'text' string field")
            if text.strip():
                out.append(text.strip())
    else:
        out = [ln.strip() for ln in lines if ln.strip()]
    if not out:
        raise ValueError(f"{p}: contains no text")
    return out


def tokenize_batches(tokenizer: Any, texts: Sequence[str], batch_size: int = 16, max_length: int = 64
                     ) -> list[dict[str, torch.Tensor]]:
    """``[{"input_ids", "attention_mask"}, ...]`` batches of ``texts`` in order (padded per batch, truncated)."""
    check_int("batch_size", batch_size, 1)
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out
