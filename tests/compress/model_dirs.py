"""Tiny model directories for the loader tests: a dense ``save_pretrained`` BERT with its tokenizer, and
the same model compressed by rankwise (``import tests.compress.model_dirs``; not a test module)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

WORDS = ("the a of to and in is it that for with as on be by this are from or not can return value "
         "file name list string object default function call data none true false number").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = [f"the value of {w} is a list of data and it can return none" for w in
         ("file", "name", "string", "object", "function", "number", "call", "default")]


def bert(vocab: int = 64, layers: int = 2, seed: int = 0, cls: str = "BertModel", **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, **kw)
    return getattr(transformers, cls)(cfg).eval()


def tokenizer(path: Path, words=WORDS):
    """A WordPiece tokenizer of the special tokens + ``words``, saved in ``path``."""
    from transformers import BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(SPECIAL + list(words)) + "\n")
    tok = BertTokenizer(str(path / "vocab.txt"))
    tok.save_pretrained(str(path))
    return tok


def dense_dir(path: Path, model=None, with_tokenizer: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tokenizer(path)
    (model if model is not None else bert()).save_pretrained(str(path))
    return path


def batches(tok, texts=TEXTS):
    enc = tok(list(texts), padding=True, return_tensors="pt")
    return [{"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}]


def compressed(method: str = "svd", ratio: float = 0.5, base=None):
    """``(compressed model, report, tokenizer source dir)`` of a tiny BERT (tokenizer written to a temp dir)."""
    import tempfile

    from rankwise.compress import CompressConfig, compress

    tok = tokenizer(Path(tempfile.mkdtemp(prefix="rankwise-test-tok.")))
    model = copy.deepcopy(base if base is not None else bert())
    rep = compress(model, CompressConfig(method=method, ratio=ratio), calib=batches(tok))
    return model, rep, tok


def outputs(model, tok, texts=TEXTS) -> torch.Tensor:
    """What the model computes on ``texts`` through ``tok`` (last hidden state or logits)."""
    enc = tok(list(texts), padding=True, return_tensors="pt")
    with torch.no_grad():
        o = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    return o.last_hidden_state if getattr(o, "last_hidden_state", None) is not None else o.logits
