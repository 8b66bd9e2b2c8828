"""SAMBAL's trained tiny GPT-2 models, built once by a fixed recipe and cached (``rankwise zoo build``).

For each recipe (:data:`RECIPES`), seed and arm ``(corpus, size)``:

1. corpus: natural sentences of the synthetic world (``SyntheticGrammar.default(0).sample(.., seed)``)
   until the data budget ``tokens`` is reached (words plus one ``<eos>`` per sentence); ``sambal``: the
   same sentences relexicalised (``Relexicalizer(scope="sentence", seed=seed)``); the controls
   ``random`` (content words replaced ignoring category) and ``shuffled`` (word order shuffled);
2. stream: ``<eos> s1 <eos> s2 <eos> ...`` under the word-level tokenizer of the grammar's vocabulary
   (:func:`rankwise.zoo.synthetic.word_tokenizer`); a further 2% of sentences (same kind) is the
   validation stream;
3. model: ``GPT2LMHeadModel`` of :data:`MODEL_SIZES` (tied embeddings), seeded initialisation;
4. training: :func:`rankwise.train.pretrain.pretrain`, AdamW (no weight decay), warm-up then cosine
   decay, clipping 1.0, ``steps = ceil(epochs * tokens / (batch * seq_len))`` -- every arm sees the same
   number of tokens; dropout draws from a fork of torch's global generator seeded with
   ``DROPOUT_SEED_OFFSET + seed`` (so a model depends on its recipe and seed only).

Files: ``cache_dir()/sambal/<recipe>-<corpus>-<size>-s<seed>-<hash>/`` (``save_pretrained`` layout plus
``sambal_info.json``), written atomically; the hash covers the recipe and the torch/transformers
major.minor versions. Cold build times: docs/methods/sambal.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rankwise.core.io import atomic_dir, read_json, write_json
from rankwise.science.sambal import Lexicon, Relexicalizer, Sentence, SyntheticGrammar, random_replacement, shuffle_words

__all__ = ["CORPORA", "MODEL_SIZES", "RECIPES", "SambalRecipe", "build", "corpus", "model_path", "new_model",
           "non_embedding_params", "tokenizer", "trained_model"]

log = logging.getLogger(__name__)

CORPORA = ("natural", "sambal", "random", "shuffled")
#: claim 4: "quarter" has 1/4 of the non-embedding parameters of "full" (4 x 12 x 64^2 vs 4 x 12 x 128^2)
MODEL_SIZES: dict[str, dict[str, int]] = {
    "full": {"n_layer": 4, "n_embd": 128, "n_head": 4},
    "quarter": {"n_layer": 4, "n_embd": 64, "n_head": 4},
    "smoke": {"n_layer": 1, "n_embd": 16, "n_head": 2},
}


@dataclass(frozen=True)
class SambalRecipe:
    tokens: int  # the data budget: tokens of the training corpus
    arms: tuple[tuple[str, str], ...]  # (corpus, model size) pairs trained for each seed
    seeds: tuple[int, ...] = (0,)
    epochs: float = 1.0  # the token budget is what every arm trains on: one pass over its corpus
    seq_len: int = 64
    batch_size: int = 32
    lr: float = 3e-3
    grad_clip: float = 1.0
    grammar_seed: int = 0
    threads: int = 1  # torch threads while training (the docs' build times use 1)
    version: int = 2  # 2: dropout on a seeded fork of the global generator (1 drew from the caller's state)

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.epochs * self.tokens / (self.batch_size * self.seq_len)))


DROPOUT_SEED_OFFSET = 1_000  # the dropout stream of seed s is torch.manual_seed(1000 + s)

_MAIN = (("natural", "full"), ("sambal", "full"))
RECIPES: dict[str, SambalRecipe] = {
    "smoke": SambalRecipe(tokens=6_000, arms=(("natural", "smoke"), ("sambal", "smoke")), epochs=1.0,
                          seq_len=32, batch_size=8),
    # quick mode (claims 1-3): the spec's 300k-token budget, one seed
    "small": SambalRecipe(tokens=300_000, arms=_MAIN),
    # a diagnostic, not a mode's recipe: the quick corpus seen four times (is the quick result about training length?)
    "small-4ep": SambalRecipe(tokens=300_000, arms=_MAIN, epochs=4.0),
    # full mode (claims 1-4): 2M tokens, three seeds, the quarter-size models of claim 4 and the two
    # syntax-destroying controls of the spec's baselines
    "full": SambalRecipe(tokens=2_000_000, arms=_MAIN + (("sambal", "quarter"), ("natural", "quarter"),
                                                         ("random", "full"), ("shuffled", "full")), seeds=(0, 1, 2)),
}


def grammar(recipe: SambalRecipe) -> SyntheticGrammar:
    return SyntheticGrammar.default(recipe.grammar_seed)


def tokenizer(g: SyntheticGrammar) -> Any:
    """The word-level tokenizer of the grammar's vocabulary (``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` first)."""
    from rankwise.zoo.synthetic import word_tokenizer

    return word_tokenizer(g.vocabulary(), model_max_length=256)


def _natural(g: SyntheticGrammar, tokens: int, seed: int, stream: str) -> list[Sentence]:
    rng = random.Random(f"sambal-{stream}-{g.seed}-{seed}")
    out, total = [], 0
    while total < tokens:
        s = g.sample_one(rng)
        out.append(s)
        total += len(s.tokens) + 1
    return out


def corpus(g: SyntheticGrammar, kind: str, tokens: int, seed: int, split: str = "train") -> list[list[str]]:
    """The sentences (word lists) of corpus ``kind`` for ``seed``: ``tokens`` tokens (``split="train"``) or
    2% of that (``"valid"``, other sentences)."""
    if kind not in CORPORA:
        raise ValueError(f"corpus kind {kind!r} is unknown; choose from {list(CORPORA)}")
    n = tokens if split == "train" else max(500, tokens // 50)
    nat = _natural(g, n, seed, split)
    if kind == "natural":
        return [s.words for s in nat]
    if kind == "sambal":
        relex = Relexicalizer(Lexicon.from_grammar(g), scope="sentence", seed=seed)
        return [relex(s).words for s in nat]
    rng = random.Random(f"sambal-control-{kind}-{seed}")
    if kind == "random":
        content = sorted({w for w, *_ in g.lexical_entries()})
        return [random_replacement(s, content, rng) for s in nat]
    return [shuffle_words(s, rng) for s in nat]


def stream(tok: Any, sentences: list[list[str]]) -> torch.Tensor:
    """``<eos> s1 <eos> s2 <eos> ...`` as one int64 tensor."""
    eos = tok.eos_token_id
    ids = tok([" ".join(s) for s in sentences], add_special_tokens=False)["input_ids"]
    flat = [eos]
    for x in ids:
        flat.extend(x)
        flat.append(eos)
    return torch.tensor(flat, dtype=torch.long)


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters outside the token and position embeddings (the LM head is tied to the embeddings)."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.endswith(("wte.weight", "wpe.weight")))


def new_model(size: str, vocab: int, seq_len: int, seed: int, tok: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    from rankwise.zoo.models import quiet_transformers, seeded

    cfg = GPT2Config(vocab_size=vocab, n_positions=seq_len, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL_SIZES[size])
    with seeded(seed), quiet_transformers():
        return GPT2LMHeadModel(cfg)


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
            "transformers": ".".join(transformers.__version__.split(".")[:2])}


def model_path(recipe_name: str, corpus_kind: str, size: str, seed: int, recipe: SambalRecipe | None = None) -> Path:
    from rankwise.zoo import cache_dir

    r = recipe or RECIPES[recipe_name]
    key = {"recipe": asdict(r), "corpus": corpus_kind, "size": size, "seed": seed, "versions": _versions()}
    for k in ("seeds", "arms", "threads"):
        key["recipe"].pop(k)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "sambal" / f"{recipe_name}-{corpus_kind}-{size}-s{seed}-{digest}"


def _train(recipe_name: str, r: SambalRecipe, corpus_kind: str, size: str, seed: int, path: Path | None) -> Any:
    from rankwise.train.pretrain import eval_windows, make_optimizer, pretrain
    from rankwise.zoo.models import build_threads, seeded

    g = grammar(r)
    tok = tokenizer(g)
    train = stream(tok, corpus(g, corpus_kind, r.tokens, seed))
    valid = stream(tok, corpus(g, corpus_kind, r.tokens, seed, split="valid"))
    with build_threads(r.threads):
        t0 = time.perf_counter()
        model = new_model(size, len(tok), r.seq_len, seed, tok)
        opt = make_optimizer("adamw", model, r.lr)
        # GPT-2's dropout draws from torch's global generator: a fork of it seeded by the model's seed
        # (offset from the initialisation's stream) makes the trained model a function of the recipe
        with seeded(DROPOUT_SEED_OFFSET + seed):
            res = pretrain(model, opt, train, eval_windows(valid, r.seq_len, 64), r.steps, seq_len=r.seq_len,
                           batch_size=r.batch_size, seed=seed, warmup=max(1, r.steps // 20),
                           eval_every=max(1, r.steps // 4), final_lr=0.1, grad_clip=r.grad_clip)
        seconds = time.perf_counter() - t0
    if res.diverged:
        raise RuntimeError(f"SAMBAL model {corpus_kind}/{size}/seed {seed} diverged at step {res.diverged_at}")
    model.eval()
    info = {"recipe_name": recipe_name, "recipe": asdict(r), "corpus": corpus_kind, "size": size, "seed": seed,
            "steps": r.steps, "train_tokens": int(train.numel()), "eval_steps": res.eval_steps,
            "eval_losses": res.eval_losses, "final_loss": res.final_loss, "build_seconds": seconds,
            "non_embedding_params": non_embedding_params(model), "versions": _versions()}
    if path is not None:
        with atomic_dir(path, overwrite=True) as tmp:
            model.save_pretrained(tmp)
            write_json(tmp / "sambal_info.json", info)
        log.info("built SAMBAL model %s in %.0f s", path.name, seconds)
    model.sambal_info = info
    return model


def trained_model(recipe_name: str, corpus_kind: str, size: str, seed: int, *, cache: bool = True,
                  rebuild: bool = False) -> Any:
    """The trained model of ``(recipe, corpus, size, seed)``, from the cache (built on first use; ``cache=False``
    trains in memory only, for smoke runs). ``model.sambal_info`` holds the build record."""
    if recipe_name not in RECIPES:
        raise ValueError(f"SAMBAL recipe {recipe_name!r} is unknown; choose from {list(RECIPES)}")
    r = RECIPES[recipe_name]
    if size not in MODEL_SIZES:
        raise ValueError(f"SAMBAL model size {size!r} is unknown; choose from {list(MODEL_SIZES)}")
    if not cache:
        return _train(recipe_name, r, corpus_kind, size, seed, None)
    path = model_path(recipe_name, corpus_kind, size, seed)
    if rebuild or not (path / "sambal_info.json").is_file():
        _train(recipe_name, r, corpus_kind, size, seed, path)
    from transformers import GPT2LMHeadModel

    from rankwise.zoo.models import quiet_transformers

    with quiet_transformers():
        model = GPT2LMHeadModel.from_pretrained(path).eval()
    model.sambal_info = read_json(path / "sambal_info.json")
    return model


def build(force: bool = False, size: str = "small") -> dict[str, Any]:
    """Build (or check) every model of recipe ``size``; what ``rankwise zoo build --size`` calls."""
    r = RECIPES[size]
    out: dict[str, Any] = {}
    for seed in r.seeds:
        for kind, msize in r.arms:
            t0 = time.perf_counter()
            m = trained_model(size, kind, msize, seed, rebuild=force)
            out[f"{kind}/{msize}/s{seed}"] = {"s": round(time.perf_counter() - t0, 1),
                                              "final_loss": round(m.sambal_info["final_loss"], 4)}
    return out
