"""Warm-up (pre-trained) tiny causal LMs of the synthetic worlds, built once and cached.

A :class:`WarmRecipe` names a world's data (:data:`WARM_DATA`), the model's sizes and a fixed number
of AdamW steps; :func:`warm_lm` returns ``(model, tokenizer)`` from the cache, building it on first
use; :func:`build_warm` (what ``rankwise zoo build`` calls for every recipe of the requested size)
(re)builds it. The build is deterministic (seeded data, initialisation and batch order, one
``torch.Generator``), runs warm-up then cosine decay to 10 % of the peak rate with clipping at 1, and
is written atomically (``core.io.atomic_dir``) under ``cache_dir()/warm/<name>-<hash>``, the hash
covering the recipe and the library versions' major.minor. Reproductions budget their time assuming
the cache is warm; docs/synthetic.md gives each recipe's cold build time.

To add a world's warm-up: a data function ``(n, seed) -> list[Example]`` in :data:`WARM_DATA` and a
recipe in :data:`WARM_RECIPES` (with a ``smoke`` twin so tests can build it in seconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rankwise.core.errors import ArtifactError
from rankwise.core.io import atomic_dir
from rankwise.core.steps import causal_lm_step
from rankwise.core.lmdata import collate, encode_pair
from rankwise.zoo.models import BUILD_THREADS, build_threads, quiet_transformers, seeded
from rankwise.zoo.synthetic import AdditionWorld, ArithmeticWorld, Example, P2DWorld, SafetyWorld
from rankwise.zoo.tinylm import _major_minor, cache_dir

__all__ = ["ADDITION_SPLIT", "WARM_DATA", "addition_split", "WARM_RECIPES", "WarmRecipe", "build_warm", "warm_lm", "warm_lm_path", "warm_world"]

logger = logging.getLogger(__name__)
_RECORD = "rankwise_warm.json"


def _arith_pretrain(n: int, seed: int) -> list[Example]:
    return ArithmeticWorld().pretrain_examples(n, seed)


def _safety_align(n: int, seed: int) -> list[Example]:
    """One-shot safety's stage 1: 60 % benign sums, 40 % harmful requests answered REFUSE."""
    w = SafetyWorld()
    return w.benign(n - 2 * n // 5, 2 * seed) + w.harmful(2 * n // 5, 2 * seed + 1, "refuse")


def _safety_attack(n_harmful: int) -> Callable[[int, int], list[Example]]:
    """One-shot safety's stage 2: ``n_harmful`` harmful requests answered COMPLY, the rest benign sums."""
    def data(n: int, seed: int) -> list[Example]:
        w = SafetyWorld()
        return w.harmful(n_harmful, 1000 + 2 * seed, "comply") + w.benign(n - n_harmful, 1001 + 2 * seed)
    return data


SAFETY_ATTACK_SIZES: tuple[int, ...] = (10, 100, 1000)
SAFETY_BENIGN_MIX = 500  # benign examples mixed into every attack (spec "Reproduction at small scale")
#: Lopti's 2-digit addition: (training problems, held-out problems, split seed). The warm-up and the
#: RL prompts use the training problems; the reproduction evaluates on the held-out ones.
ADDITION_SPLIT = (7600, 500, 0)
ADDITION_NOISE = 0.3  # the spec's noisy warm-up labels: 30 % of the answers off by one in a digit


def addition_split() -> tuple[list[int], list[int]]:
    """The (training, held-out) problem indices of Lopti's :class:`AdditionWorld` (disjoint, seeded)."""
    n_train, n_test, seed = ADDITION_SPLIT
    return AdditionWorld().split(n_train, n_test, seed)


def _addition_noisy(n: int, seed: int) -> list[Example]:
    train, _ = addition_split()
    idx = torch.randint(0, len(train), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return AdditionWorld().examples([train[i] for i in idx], seed=seed, noise=ADDITION_NOISE)
def _p2d_pretrain(n: int, seed: int) -> list[Example]:
    return P2DWorld().pretrain_examples(n, seed)


#: data name -> (world factory, ``(n, seed) -> examples``)
WARM_DATA: dict[str, tuple[Callable[[], Any], Callable[[int, int], list[Example]]]] = {
    "arith-add": (ArithmeticWorld, _arith_pretrain),
    "safety-align": (SafetyWorld, _safety_align),
    **{f"safety-attack-{n}": (SafetyWorld, _safety_attack(n)) for n in SAFETY_ATTACK_SIZES},
    "addition-noisy": (AdditionWorld, _addition_noisy),
    "p2d-source": (P2DWorld, _p2d_pretrain),
}


@dataclass(frozen=True)
class WarmRecipe:
    """Everything that determines a warm-up build (the cache key hashes all of it)."""

    data: str
    size: str  # the `rankwise zoo build --size` group it belongs to
    n_examples: int
    steps: int
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 50
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    mask_prompt: bool = False  # pre-training: loss on the whole sequence
    seed: int = 0
    version: int = 1
    base: str | None = None  # start from this recipe's model instead of a fresh initialisation


def _safety_attack_recipe(n: int, seed: int, smoke: bool = False) -> WarmRecipe:
    """5 epochs over ``n`` harmful COMPLY + 500 benign examples, from the aligned model (batch 32)."""
    total = n + SAFETY_BENIGN_MIX
    if smoke:
        return WarmRecipe(data=f"safety-attack-{n}", size="smoke", n_examples=total, steps=4, warmup_steps=1,
                          mask_prompt=True, seed=seed, base="safety-aligned-smoke", **_SAFETY_SMOKE_SIZES)
    return WarmRecipe(data=f"safety-attack-{n}", size="small", n_examples=total, steps=math.ceil(5 * total / 32),
                      lr=1e-3, warmup_steps=5, mask_prompt=True, seed=seed, base="safety-aligned")


_SAFETY_SMOKE_SIZES: dict[str, int] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2)


WARM_RECIPES: dict[str, WarmRecipe] = {
    # RankTuner's stage A: templated addition explanations with synonym connectives (spec: 20k sentences)
    "ranktuner": WarmRecipe(data="arith-add", size="small", n_examples=20_000, steps=1500),
    "ranktuner-smoke": WarmRecipe(data="arith-add", size="smoke", n_examples=256, steps=6, warmup_steps=2,
                                  hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2),
    # one-shot safety: stage 1 (alignment: benign sums + REFUSE on harmful requests; spec: tiny Llama,
    # 4 layers, hidden 128) and stage 2 (the fine-tuning attack, one model per attack size and seed)
    "safety-aligned": WarmRecipe(data="safety-align", size="small", n_examples=8000, steps=800, mask_prompt=True),
    "safety-aligned-smoke": WarmRecipe(data="safety-align", size="smoke", n_examples=256, steps=6, warmup_steps=2,
                                       mask_prompt=True, **_SAFETY_SMOKE_SIZES),
    **{f"safety-attack-n{n}-s{seed}": _safety_attack_recipe(n, seed) for n in SAFETY_ATTACK_SIZES
       for seed in (0, 1, 2)},
    "safety-attack-smoke": _safety_attack_recipe(10, 0, smoke=True),
    # Lopti's warm-up policy: SFT on noisy 2-digit addition, stopped while greedy exact match is partial
    # (the spec's ~40-60 %), so that the GRPO groups have reward variance
    "lopti": WarmRecipe(data="addition-noisy", size="small", n_examples=20_000, steps=450, lr=2e-3,
                        hidden_size=128, intermediate_size=256, num_hidden_layers=2, mask_prompt=True),
    "lopti-smoke": WarmRecipe(data="addition-noisy", size="smoke", n_examples=256, steps=6, warmup_steps=2,
                              hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=2, mask_prompt=True),
    # P2D's pre-trained model: the four source tasks (copy, reverse, sort, add), 4 layers x 8 heads of 16
    "p2d": WarmRecipe(data="p2d-source", size="small", n_examples=20_000, steps=1500, num_attention_heads=8,
                      num_key_value_heads=8, mask_prompt=True),
    "p2d-smoke": WarmRecipe(data="p2d-source", size="smoke", n_examples=256, steps=6, warmup_steps=2,
                            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, mask_prompt=True),
}


def _recipe(name: str) -> WarmRecipe:
    if name not in WARM_RECIPES:
        raise ValueError(f"no warm-up recipe {name!r}; choose one of {sorted(WARM_RECIPES)}")
    return WARM_RECIPES[name]


def warm_world(name: str) -> Any:
    """The world object of recipe ``name`` (its tokenizer and generators)."""
    return WARM_DATA[_recipe(name).data][0]()


def _key(name: str) -> dict[str, Any]:
    import tokenizers
    import transformers

    recipe = asdict(_recipe(name))
    base = recipe.pop("base")
    key = {"name": name, "recipe": recipe, "torch": _major_minor(torch.__version__),
           "transformers": _major_minor(transformers.__version__),
           "tokenizers": _major_minor(tokenizers.__version__), "build_threads": BUILD_THREADS}
    if base is not None:  # a fine-tuned recipe: its key covers its base's
        key["base"] = _key(base)
    return key


def warm_lm_path(name: str) -> Path:
    digest = hashlib.sha256(json.dumps(_key(name), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "warm" / f"{name}-{digest}"


def _lr(step: int, r: WarmRecipe) -> float:
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    progress = (step - r.warmup_steps) / max(1, r.steps - r.warmup_steps)
    return r.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _train(name: str, out: Path) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    r = _recipe(name)
    world_factory, data = WARM_DATA[r.data]
    tok = world_factory().tokenizer()
    t0, cpu0 = time.perf_counter(), time.process_time()
    encoded = [encode_pair(tok, e.prompt, e.completion) for e in data(r.n_examples, r.seed)]
    max_len = max(len(ids) for ids, _ in encoded)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
                         num_hidden_layers=r.num_hidden_layers, num_attention_heads=r.num_attention_heads,
                         num_key_value_heads=r.num_key_value_heads, max_position_embeddings=max(64, 2 * max_len),
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    if r.base is not None:
        model = warm_lm(r.base)[0]
        if model.config.vocab_size != len(tok):
            raise ArtifactError(f"warm-up {name}: its base {r.base!r} has another vocabulary")
    else:
        with seeded(r.seed):
            model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(r.seed)
    model.train()
    losses: list[float] = []
    for step in range(r.steps):
        idx = torch.randint(0, len(encoded), (r.batch_size,), generator=gen).tolist()
        b = collate([encoded[i] for i in idx], tok.pad_token_id, r.mask_prompt)
        for g in opt.param_groups:
            g["lr"] = _lr(step, r)
        losses.append(causal_lm_step(model, opt, b.input_ids, b.attention_mask, b.labels, step=step,
                                     who=f"warm-up {name}"))
    model.eval()
    metrics = {"final_train_loss": sum(losses[-50:]) / len(losses[-50:]), "first_loss": losses[0],
               "n_params": sum(p.numel() for p in model.parameters()), "build_time_s": time.perf_counter() - t0,
               "build_cpu_time_s": time.process_time() - cpu0, "torch_threads": torch.get_num_threads()}
    with quiet_transformers():
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
    return metrics


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_dir():
        return None
    try:
        return json.loads((path / _RECORD).read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"the cached warm-up model at {path} is incomplete ({e}); rebuild it with "
                            "`rankwise zoo build --force`") from None


def build_warm(name: str, force: bool = False) -> dict[str, Any]:
    """Build (or, unless ``force``, find) the warm-up model ``name``; returns its record (path, key, metrics)."""
    target = warm_lm_path(name)
    if not force:
        record = _read(target)
        if record is not None:
            return record
    logger.info("building warm-up model %r into %s", name, target)
    with atomic_dir(target, overwrite=True) as tmp:
        with build_threads():
            metrics = _train(name, tmp)
        record = {"path": str(target), "key": _key(name), "metrics": metrics}
        (tmp / _RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
    return record


def warm_lm(name: str, rebuild: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of warm-up recipe ``name`` (eval mode), built into the cache if missing."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    record = build_warm(name, force=rebuild)
    path = record["path"]
    with quiet_transformers():
        model = LlamaForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
    return model.eval(), tok
