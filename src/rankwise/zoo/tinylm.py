"""A tiny causal LM pretrained locally on the docstring corpus, built once and cached.

Recipe (:data:`RECIPES`, all deterministic):

1. Tokenizer: a byte-level BPE (the GPT-2 scheme: every UTF-8 byte is a base symbol, so any text
   encodes without unknown tokens) trained with the ``tokenizers`` library on the corpus' ``train``
   split. Special tokens ``<|endoftext|>`` (id 0; BOS/EOS/document separator) and ``<|pad|>`` (id 1).
   The tokenizer adds no special tokens on its own. ``tokenizers``' BPE trainer has no randomness
   and sorts its alphabet, so the same text gives the same merges in every process.
2. Model: ``LlamaForCausalLM`` from a ``LlamaConfig`` (sizes in the recipe), initialised under the
   recipe seed.
3. Data: the ``train`` documents tokenised and concatenated, each followed by ``<|endoftext|>``.
   Each step draws ``batch_size`` windows of ``seq_len`` tokens at uniformly random offsets from a
   ``torch.Generator`` seeded with the recipe seed.
4. Optimiser: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine
   decay to 10 % of the peak rate, gradient clipping at norm 1, a fixed number of steps.
5. Evaluation: perplexity on the ``eval`` split (modules never seen in training), in consecutive
   non-overlapping windows of ``seq_len`` tokens, against a unigram model of the training tokens
   (add-one smoothing) scored on exactly the same predicted tokens.

The result is cached under ``cache_dir()/tiny_lm/<size>-<hash>``, where the hash covers the recipe,
the corpus' SHA-256 (so a different Python version, which changes the docstrings, gets its own
model) and the library versions' major.minor. It is written by ``save_pretrained`` (safetensors)
into a temporary folder that is renamed into place, so an interrupted build leaves no half model.
``cache_dir()`` is ``$RANKWISE_CACHE_DIR`` when set, else ``platformdirs.user_cache_dir("rankwise")``.

Numbers are bit-reproducible on the same machine with the same thread count; float reductions may
differ across CPUs or thread counts, so the cached artefact (not a rebuild) is the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from rankwise.core.calibration import token_nll
from rankwise.core.errors import ArtifactError, RankwiseError
from rankwise.zoo.docstrings import SPLITS, corpus
from rankwise.zoo.models import BUILD_THREADS, build_threads, quiet_transformers, seeded

__all__ = [
    "BUILD_SETS",
    "RECIPES",
    "TinyLMRecipe",
    "build_tiny_lm",
    "cache_dir",
    "perplexity",
    "tiny_lm",
    "tiny_lm_info",
    "tiny_lm_path",
    "token_batches",
    "token_stream",
]

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
PAD = "<|pad|>"
_METRICS = "rankwise_tiny_lm.json"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", _METRICS)


@dataclass(frozen=True)
class TinyLMRecipe:
    """Everything that determines a tiny LM build (the cache key hashes all of it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    tokenizer_min_frequency: int = 2
    tokenizer_max_docs: int | None = None  # None: the whole train split
    max_eval_tokens: int | None = None  # None: the whole eval split
    version: int = 1  # bump when the build code changes what a recipe produces
    # architecture: "llama" (LlamaForCausalLM; GQA when num_key_value_heads < num_attention_heads) or
    # "qwen2_moe" (Qwen2MoeForCausalLM: every layer a routed mixture of experts plus a gated shared
    # expert; trained with the router's load-balancing loss). The MoE fields are ignored for "llama".
    arch: str = "llama"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.0


# fields added after the first recipes were cached: left out of the cache key while at their default,
# so that adding them did not invalidate the caches of the Llama recipes
_LATE_FIELDS = {"arch": "llama", "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
                "shared_expert_intermediate_size": 0, "router_aux_loss_coef": 0.0}


RECIPES: dict[str, TinyLMRecipe] = {
    # seconds; for tests: checks the wiring, not the quality
    "smoke": TinyLMRecipe(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, seq_len=32, batch_size=4, steps=8,
                          lr=3e-3, warmup_steps=2, tokenizer_max_docs=300, max_eval_tokens=2048),
    # about 1-3 minutes on 2 CPU cores
    "small": TinyLMRecipe(vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, seq_len=128, batch_size=16,
                          steps=600, lr=3e-3, warmup_steps=30),
    # a grouped-query-attention Llama trained at context 1024: 8 query heads of dim 32 sharing 2 KV
    # heads (SANTA's decode attention, STAR-KV's per-head key ranks)
    "gqa-smoke": TinyLMRecipe(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=8, num_key_value_heads=2, seq_len=256, batch_size=2, steps=6,
                              lr=3e-3, warmup_steps=2, tokenizer_max_docs=300, max_eval_tokens=2048),
    # (two layers and batch 2 keep the build near 6 CPU minutes: a step of 2 x 1024 tokens costs ~1 CPU s)
    "gqa": TinyLMRecipe(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, seq_len=1024, batch_size=2, steps=400,
                        lr=2e-3, warmup_steps=30),
    # a Qwen2-MoE: 8 routed experts (top-2, expert FFN 64) and a shared expert in every layer (HEAPr)
    "moe-smoke": TinyLMRecipe(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=2, seq_len=32, batch_size=4, steps=8,
                              lr=3e-3, warmup_steps=2, tokenizer_max_docs=300, max_eval_tokens=2048,
                              arch="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                              shared_expert_intermediate_size=32, router_aux_loss_coef=0.01),
    "moe": TinyLMRecipe(vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, seq_len=128, batch_size=16, steps=600,
                        lr=3e-3, warmup_steps=30, arch="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=64, shared_expert_intermediate_size=128, router_aux_loss_coef=0.01),
}

#: what ``rankwise zoo build --size S`` builds of the tiny LMs
BUILD_SETS: dict[str, tuple[str, ...]] = {"smoke": ("smoke", "gqa-smoke", "moe-smoke"),
                                          "small": ("small", "gqa", "moe")}


def cache_dir() -> Path:
    """Where the zoo caches built artefacts: ``$RANKWISE_CACHE_DIR`` or the platform's user cache."""
    env = os.environ.get("RANKWISE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("rankwise"))


def _recipe(size: str) -> TinyLMRecipe:
    if size not in RECIPES:
        raise ValueError(f"size={size!r} is not a tiny_lm size; choose one of {list(RECIPES)}")
    return RECIPES[size]


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _recipe_key(size: str) -> dict[str, Any]:
    import tokenizers
    import transformers

    recipe = {k: v for k, v in asdict(_recipe(size)).items() if k not in _LATE_FIELDS or v != _LATE_FIELDS[k]}
    return {
        "size": size,
        "recipe": recipe,
        "corpus_sha256": corpus().info["sha256"],
        "torch": _major_minor(torch.__version__),
        "transformers": _major_minor(transformers.__version__),
        "tokenizers": _major_minor(tokenizers.__version__),
        "build_threads": BUILD_THREADS,
    }


def tiny_lm_path(size: str = "small") -> Path:
    """The cache folder of the tiny LM ``size`` (it may not exist yet)."""
    key = _recipe_key(size)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "tiny_lm" / f"{size}-{digest}"


# --------------------------------------------------------------------------------------------------
# data helpers (also useful to reproductions: calibration and evaluation batches from the corpus)


def _train_tokenizer(recipe: TinyLMRecipe) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    docs = [d.text for d in corpus().split("train")]
    if recipe.tokenizer_max_docs is not None:
        docs = docs[: recipe.tokenizer_max_docs]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size, min_frequency=recipe.tokenizer_min_frequency,
        special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=recipe.seq_len * 2)


def token_stream(tokenizer: Any, split: str = "train") -> torch.Tensor:
    """The documents of corpus ``split`` tokenised and concatenated, each followed by EOS.

    Returns a 1-D int64 tensor. ``tokenizer`` is any Hugging Face tokenizer with an EOS (or SEP)
    token, e.g. the tiny LM's or MiniLM's.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not a corpus split; choose one of {list(SPLITS)}")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if eos is None:
        raise ValueError("the tokenizer has neither an EOS nor a SEP token to separate documents")
    texts = [d.text for d in corpus().split(split)]
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    flat: list[int] = []
    for seq in ids:
        flat.extend(seq)
        flat.append(eos)
    return torch.tensor(flat, dtype=torch.long)


def token_batches(tokenizer: Any, split: str = "calib", seq_len: int = 128, batch_size: int = 8,
                  n_batches: int | None = None, seed: int | None = None) -> list[torch.Tensor]:
    """Batches of token windows from corpus ``split``, shape (batch_size, seq_len) each.

    With ``seed=None`` the windows are the consecutive non-overlapping windows of the split (the
    last partial batch is dropped) up to ``n_batches`` batches; with a seed, ``n_batches`` batches of
    windows at random offsets drawn from ``torch.Generator().manual_seed(seed)``.
    """
    for field, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive int")
    stream = token_stream(tokenizer, split)
    if len(stream) < seq_len:
        raise ValueError(f"split {split!r} has {len(stream)} tokens, fewer than seq_len={seq_len}")
    if seed is None:
        windows = stream[: (len(stream) // seq_len) * seq_len].view(-1, seq_len)
        batches = list(windows[: (len(windows) // batch_size) * batch_size].split(batch_size))
        return batches if n_batches is None else batches[:n_batches]
    if n_batches is None or n_batches < 1:
        raise ValueError("n_batches must be a positive int when a seed is given")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        starts = torch.randint(0, len(stream) - seq_len + 1, (batch_size,), generator=gen)
        out.append(torch.stack([stream[s:s + seq_len] for s in starts.tolist()]))
    return out


@torch.no_grad()
def perplexity(model: torch.nn.Module, tokenizer: Any, split: str = "eval", seq_len: int = 128,
               batch_size: int = 16, max_tokens: int | None = None) -> float:
    """Perplexity of a causal LM on corpus ``split`` in non-overlapping windows of ``seq_len`` tokens.

    exp(mean negative log-likelihood) over every token of every window except the window's first;
    accumulated in float64. Raises :class:`~rankwise.core.errors.NumericalError` on non-finite loss.
    """
    return math.exp(_eval_nll(model, token_stream(tokenizer, split), seq_len, batch_size, max_tokens)[0])


def _windows(stream: torch.Tensor, seq_len: int, max_tokens: int | None) -> torch.Tensor:
    if max_tokens is not None:
        stream = stream[:max_tokens]
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"only {len(stream)} tokens, fewer than seq_len={seq_len}")
    return stream[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def _eval_nll(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, batch_size: int,
              max_tokens: int | None) -> tuple[float, torch.Tensor]:
    windows = _windows(stream, seq_len, max_tokens)
    total, count = token_nll(model, windows, batch_size, who="perplexity()")
    return total / count, windows[:, 1:].reshape(-1)


def _unigram_nll(train: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[targets].mean())


# --------------------------------------------------------------------------------------------------
# build


def _lr_at(step: int, recipe: TinyLMRecipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@contextlib.contextmanager
def _progress(enabled: bool, total: int, label: str) -> Iterator[Any]:
    if not enabled:
        yield lambda **_: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  transient=True) as bar:
        task = bar.add_task(label, total=total, info="")
        yield lambda **kw: bar.update(task, advance=1, info=" ".join(f"{k}={v}" for k, v in kw.items()))


def _new_model(recipe: TinyLMRecipe, tokenizer: Any) -> Any:
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, max_position_embeddings=2 * recipe.seq_len,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    if recipe.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    elif recipe.arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        fields.update(num_experts=recipe.num_experts, num_experts_per_tok=recipe.num_experts_per_tok,
                      moe_intermediate_size=recipe.moe_intermediate_size,
                      shared_expert_intermediate_size=recipe.shared_expert_intermediate_size,
                      router_aux_loss_coef=recipe.router_aux_loss_coef, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
        config_cls, model_cls = Qwen2MoeConfig, Qwen2MoeForCausalLM
    else:
        raise ValueError(f"TinyLMRecipe.arch must be 'llama' or 'qwen2_moe', got {recipe.arch!r}")
    with seeded(recipe.seed):
        return model_cls(config_cls(**fields))


def _train(size: str, out: Path, progress: bool) -> dict[str, Any]:
    recipe = _recipe(size)
    t0, cpu0 = time.perf_counter(), time.process_time()
    tokenizer = _train_tokenizer(recipe)
    train_stream = token_stream(tokenizer, "train")
    eval_stream = token_stream(tokenizer, "eval")
    model = _new_model(recipe, tokenizer)
    # the MoE recipe adds the router's load-balancing loss (weighted by router_aux_loss_coef) while training
    router_loss = {"output_router_logits": True} if recipe.arch == "qwen2_moe" else {}
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(recipe.seed)
    n_start = len(train_stream) - recipe.seq_len
    if n_start < 1:
        raise RankwiseError(f"the train split has only {len(train_stream)} tokens")
    offsets = torch.arange(recipe.seq_len)
    model.train()
    losses: list[float] = []
    t_train = time.perf_counter()
    with _progress(progress, recipe.steps, f"tiny_lm {size}") as tick:
        for step in range(recipe.steps):
            starts = torch.randint(0, n_start + 1, (recipe.batch_size, 1), generator=gen)
            batch = train_stream[starts + offsets]
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, recipe)
            loss = model(input_ids=batch, labels=batch, **router_loss).loss
            if not torch.isfinite(loss):
                from rankwise.core.errors import NumericalError

                raise NumericalError(f"tiny_lm {size}: non-finite training loss at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            opt.step()
            losses.append(loss.item())
            tick(loss=f"{losses[-1]:.3f}")
    train_s = time.perf_counter() - t_train
    model.eval()
    nll, targets = _eval_nll(model, eval_stream, recipe.seq_len, 16, recipe.max_eval_tokens)
    uni = _unigram_nll(train_stream, targets, len(tokenizer))
    metrics = {
        "val_ppl": math.exp(nll),
        "val_loss": nll,
        "unigram_val_ppl": math.exp(uni),
        "val_tokens": int(targets.numel()),
        "train_tokens": int(train_stream.numel()),
        "epochs": recipe.steps * recipe.batch_size * recipe.seq_len / train_stream.numel(),
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "n_params": sum(p.numel() for p in model.parameters()),
        "train_time_s": train_s,
        "build_time_s": time.perf_counter() - t0,
        "build_cpu_time_s": time.process_time() - cpu0,
        "torch_threads": torch.get_num_threads(),
    }
    with quiet_transformers():
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    return metrics


def build_tiny_lm(size: str = "small", force: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """Build (or, unless ``force``, find) the cached tiny LM ``size``; returns its record.

    The record (also stored as ``rankwise_tiny_lm.json`` in the folder) holds ``path``, the recipe
    key and the metrics (validation perplexity, unigram perplexity, times, ...). The build runs in a
    temporary folder next to the target that is renamed into place; if another process finished
    the same build first, its result is kept.
    """
    target = tiny_lm_path(size)
    if not force:
        record = _read_record(target)
        if record is not None:
            return record
    if progress is None:
        progress = sys.stderr.isatty()
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building tiny_lm %r into %s", size, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with build_threads():
            metrics = _train(size, tmp, progress)
        record = {"path": str(target), "key": _recipe_key(size), "metrics": metrics}
        (tmp / _METRICS).write_text(json.dumps(record, indent=2, sort_keys=True))
        if target.exists():
            if not force:  # a concurrent build won the race; keep its result
                shutil.rmtree(tmp, ignore_errors=True)
                return _read_record(target) or record
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, trash / "old")
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.replace(tmp, target)
            except OSError:  # created by a concurrent build between the check and the rename
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tiny_lm %r: validation perplexity %.2f (unigram %.2f), %.1f s", size,
                metrics["val_ppl"], metrics["unigram_val_ppl"], metrics["build_time_s"])
    return _read_record(target) or record


def _read_record(path: Path) -> dict[str, Any] | None:
    if not path.is_dir():
        return None
    missing = [f for f in _REQUIRED if not (path / f).is_file()]
    if missing:
        raise ArtifactError(f"the cached tiny LM at {path} is incomplete (missing {missing}); rebuild it "
                            "with tiny_lm(size, rebuild=True) or `rankwise zoo build --force`")
    try:
        record = json.loads((path / _METRICS).read_text())
    except ValueError as exc:
        raise ArtifactError(f"{path / _METRICS} is not valid JSON ({exc}); rebuild with rebuild=True") from exc
    record["path"] = str(path)
    return record


def tiny_lm_info(size: str = "small", build: bool = True) -> dict[str, Any] | None:
    """The record (path, recipe key, metrics) of the cached tiny LM; builds it if ``build``."""
    if build:
        return build_tiny_lm(size)
    return _read_record(tiny_lm_path(size))


def tiny_lm(size: str = "small", rebuild: bool = False, progress: bool | None = None) -> tuple[Any, Any]:
    """A tiny Llama causal LM pretrained on the corpus' train split, and its tokenizer.

    ``size="small"``: vocabulary 2,048 byte-level BPE, hidden 128, 4 layers, 4 heads, FFN 344
    (about 1.3M parameters), trained 600 steps of 16 x 128 tokens; the first call builds it (about
    1-3 min on 2 CPU cores) and caches it, later calls load it (well under a second).
    ``size="smoke"``: a few-second build for tests. ``rebuild=True`` retrains and replaces the cache.
    ``size="gqa"``: a grouped-query Llama (hidden 256, 2 layers, 8 query heads of dim 32 over 2 KV
    heads, FFN 688) trained 400 steps of 2 x 1024 tokens (context 1024). ``size="moe"``: a
    Qwen2-MoE (hidden 128, 4 layers, 8 routed experts top-2 with expert FFN 64 plus a gated shared
    expert of FFN 128), trained like ``small`` with the router's load-balancing loss.
    ``gqa-smoke`` / ``moe-smoke``: seconds-long builds of the same architectures for tests.
    Returns ``(causal LM in eval mode, PreTrainedTokenizerFast)``; see :func:`tiny_lm_info`
    for the measured perplexities.
    """
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    record = build_tiny_lm(size, force=rebuild, progress=progress)
    path = record["path"]
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot load the cached tiny LM at {path} ({exc}); rebuild it with "
                            f"tiny_lm({size!r}, rebuild=True)") from exc
    return model.eval(), tokenizer
