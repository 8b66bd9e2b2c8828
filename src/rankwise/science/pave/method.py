"""Computing a PAVE specification: frozen shared A, B-only fine-tune, ``tau = vec(B)`` (spec §1-§3).

:func:`pave_spec` takes any Hugging Face encoder (its ``last_hidden_state`` is mean-pooled over real
tokens) with its tokenizer and a labelled text set. :func:`spec_from_inputs` is the same on pre-built
input tensors and any encoder module whose forward returns hidden states ``(B, L, H)`` (or an output with
``last_hidden_state``), e.g. the top layers of a model run on cached lower-layer outputs.

Steps (all on a copy: the caller's model is never changed):

1. attach a LoRA adapter (rank r, alpha, dropout) to the selected Linear layers, through
   :func:`rankwise.core.lora.add_lora` or PEFT's ``inject_adapter_in_model`` (``config.backend``);
   every ``lora_A`` is overwritten by :func:`shared_a` (kaiming-uniform, drawn from a generator seeded
   by ``a_seed`` and the module name) and frozen; every ``lora_B`` starts at zero;
2. add a zero-initialised linear head ``H -> num_labels`` on the mean-pooled features;
3. train B and the head with AdamW (lr, decoupled weight decay), linear warm-up then cosine (or linear,
   constant) decay, gradient-norm clip, loss = cross-entropy + ``(lambda / n_B) * sum ||B||_1`` (the
   induced matrix 1-norm, or element-wise), batches drawn from ``Generator(seed)``, LoRA dropout from the
   global RNG seeded with ``seed`` inside :func:`torch.random.fork_rng` (the caller's RNG state is kept).
   The base model runs in eval mode (no dropout in theta_0), so a frozen prefix may be cached exactly;
4. ``tau`` = the trained B's (B_before = 0) and the head, as a :class:`PaveSpec`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import numbers
import re
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from rankwise.core import io
from rankwise.core.errors import SelectionError
from rankwise.core.select import select
from rankwise.science.pave.config import PaveConfig
from rankwise.science.pave.spec import PaveSpec

__all__ = ["ADAPTER", "SpecFit", "fit_spec", "l1_penalty", "lr_factor", "pave_spec", "select_targets", "shared_a", "spec_from_inputs"]

ADAPTER = "pave"
_DIGITS = re.compile(r"^\d+$")


def shared_a(module: str, in_features: int, rank: int, a_seed: int) -> torch.Tensor:
    """The frozen shared ``A`` (rank, in_features) of ``module``: kaiming-uniform(a = sqrt 5), PEFT's draw.

    Drawn on CPU in float32 from ``Generator(seed)`` with ``seed`` the first 8 bytes of
    ``sha256(f"{a_seed}:{module}")``, so it depends only on ``a_seed``, the module name and the shape.
    """
    digest = hashlib.sha256(f"{a_seed}:{module}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") & (2**63 - 1))
    a = torch.empty(rank, in_features, dtype=torch.float32)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
    return a


def _layer_index(name: str) -> int | None:
    for part in name.split("."):
        if _DIGITS.match(part):
            return int(part)
    return None


def select_targets(model: nn.Module, config: PaveConfig) -> list[tuple[str, nn.Linear]]:
    """The Linear layers a spec adapts: ``target_modules`` matches, restricted to ``layers`` when given.

    Raises :class:`SelectionError` when nothing matches and ``ValueError`` when ``rank`` exceeds
    ``min(in, out)`` of a target.
    """
    try:
        hits = [(n, m) for n, m in select(model, config.target_modules) if isinstance(m, nn.Linear)]
    except SelectionError as e:
        raise SelectionError(f"PaveConfig.target_modules={list(config.target_modules)} matches no module of this "
                             f"model (a model of another kind than the config was written for?): {e}") from None
    if config.layers is not None:
        hits = [(n, m) for n, m in hits if _layer_index(n) in config.layers]
    if not hits:
        raise SelectionError(f"no Linear layer of this model matches target_modules={list(config.target_modules)}"
                             f"{f' in layers {list(config.layers)}' if config.layers is not None else ''}; "
                             "is it the kind of model the config was written for?")
    for n, m in hits:
        if config.rank > min(m.in_features, m.out_features):
            raise ValueError(f"PaveConfig.rank={config.rank} exceeds min(in_features={m.in_features}, "
                             f"out_features={m.out_features}) of {n!r}")
    return hits


def l1_penalty(bs: Sequence[torch.Tensor], kind: str = "induced") -> torch.Tensor:
    """``(1 / n) * sum_i ||B_i||_1`` over ``n`` tensors: the induced matrix 1-norm (largest absolute column
    sum, ``torch.linalg.matrix_norm(B, ord=1)``) or the element-wise sum of absolute values."""
    if not bs:
        raise ValueError("l1_penalty needs at least one tensor")
    if kind == "induced":
        terms = [torch.linalg.matrix_norm(b, ord=1) for b in bs]
    elif kind == "elementwise":
        terms = [b.abs().sum() for b in bs]
    else:
        raise ValueError(f"l1 kind must be 'induced' or 'elementwise', got {kind!r}")
    return torch.stack(terms).sum() / len(bs)


def lr_factor(step: int, config: PaveConfig) -> float:
    """Multiplier of the learning rate at ``step`` (0-based): linear warm-up then the schedule's decay."""
    warm = math.ceil(config.warmup_ratio * config.steps)
    if step < warm:
        return (step + 1) / warm
    if config.schedule == "constant":
        return 1.0
    progress = (step - warm) / max(1, config.steps - warm)
    if config.schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _attach(model: nn.Module, config: PaveConfig) -> tuple[list[tuple[str, nn.Parameter, nn.Parameter]], nn.Module]:
    """Attach the shared adapter to ``model`` (a private copy); returns ``[(module, A, B)]`` and the model."""
    targets = [n for n, _ in select_targets(model, config)]
    if config.backend == "rankwise":
        from rankwise.core.lora import add_lora, lora_layers

        add_lora(model, lambda n, m: n in targets, ADAPTER, rank=config.rank, alpha=config.alpha,
                 dropout=config.dropout, generator=torch.Generator().manual_seed(0))
        layers = dict(lora_layers(model))
        factors = [(n, layers[n].lora_A[ADAPTER].weight, layers[n].lora_B[ADAPTER].weight) for n in targets]
    else:
        import peft

        pc = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                             target_modules=list(targets), bias="none")
        with torch.random.fork_rng(devices=[]):
            model = peft.inject_adapter_in_model(pc, model)
        mods = dict(model.named_modules())
        factors = [(n, mods[n].lora_A["default"].weight, mods[n].lora_B["default"].weight) for n in targets]
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        for n, a, b in factors:
            a.copy_(shared_a(n, a.shape[1], config.rank, config.a_seed).to(a.dtype))
            b.zero_()
            b.requires_grad_(True)
    return factors, model


def _hidden(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    h = getattr(out, "last_hidden_state", None)
    if h is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        h = out[0]
    if h is None:
        raise TypeError(f"the encoder must return hidden states (B, L, H) or an output with last_hidden_state, "
                        f"got {type(out).__name__}")
    return h


def _check_inputs(inputs: Mapping[str, torch.Tensor], labels: torch.Tensor, config: PaveConfig) -> int:
    if "attention_mask" not in inputs:
        raise ValueError("inputs must hold an 'attention_mask' (B, L) for mean pooling")
    n = int(labels.shape[0]) if labels.ndim == 1 else -1
    if n < 1:
        raise ValueError("empty data: a spec needs at least one labelled example")
    for k, v in inputs.items():
        if not isinstance(v, torch.Tensor) or v.shape[0] != n:
            raise ValueError(f"inputs[{k!r}] must be a tensor with {n} rows (one per label), got "
                             f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    if labels.dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16) or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= config.num_labels:
        raise ValueError(f"labels must lie in [0, {config.num_labels}) (PaveConfig.num_labels={config.num_labels}), "
                         f"got values in [{lo}, {hi}]")
    return n


def _batches(n: int, config: PaveConfig) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(config.seed)
    size = min(config.batch_size, n)
    out: list[torch.Tensor] = []
    while len(out) < config.steps:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n - size + 1, size):
            out.append(order[start:start + size])
            if len(out) == config.steps:
                break
    return out


@dataclass
class SpecFit:
    """What :func:`fit_spec` returns: the ``spec``, the adapted private copy of the encoder (``model``, with
    the trained adapter named :data:`ADAPTER`), the trained ``head`` and the ``factors`` ``[(module, A, B)]``
    (the live parameters of ``model``), for inspection: every A is still :func:`shared_a` of its module."""

    spec: PaveSpec
    model: nn.Module
    head: nn.Linear
    factors: list[tuple[str, nn.Parameter, nn.Parameter]]


def spec_from_inputs(encoder: nn.Module, inputs: Mapping[str, torch.Tensor], labels: torch.Tensor | Sequence[int],
                     config: PaveConfig | None = None, *, fingerprint: str | None = None,
                     base_model: str | None = None) -> PaveSpec:
    """The PAVE spec of a labelled data set given as input tensors (see the module docstring).

    ``inputs``: keyword arguments of ``encoder.forward`` with one row per example, including
    ``attention_mask`` (N, L); ``labels``: (N,) ints in ``[0, num_labels)``. ``fingerprint`` defaults to
    the encoder's :func:`~rankwise.core.io.model_fingerprint`. ``encoder`` is not modified.
    """
    return fit_spec(encoder, inputs, labels, config, fingerprint=fingerprint, base_model=base_model).spec


def fit_spec(encoder: nn.Module, inputs: Mapping[str, torch.Tensor], labels: torch.Tensor | Sequence[int],
             config: PaveConfig | None = None, *, fingerprint: str | None = None,
             base_model: str | None = None) -> SpecFit:
    """:func:`spec_from_inputs`, also returning the trained copy (a :class:`SpecFit`)."""
    config = config or PaveConfig()
    labels = torch.as_tensor(labels)
    n = _check_inputs(inputs, labels, config)
    t0 = time.perf_counter()
    fp = fingerprint or io.model_fingerprint(encoder)
    work = copy.deepcopy(encoder)
    factors, work = _attach(work, config)
    work.eval()
    for name, mod in work.named_modules():
        if "lora_dropout" in name.split(".")[-2:]:
            mod.train()
    hidden_size = 0
    head: nn.Linear | None = None
    bs = [b for _, _, b in factors]
    losses: list[float] = []
    ces: list[float] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        opt = sched = None
        for step, idx in enumerate(_batches(n, config)):
            feats = _forward(work, inputs, idx)
            if head is None:
                hidden_size = int(feats.shape[-1])
                head = nn.Linear(hidden_size, config.num_labels, dtype=feats.dtype)
                nn.init.zeros_(head.bias)
                if config.head:
                    nn.init.zeros_(head.weight)
                else:  # a fixed head shared by every spec (a zero head would pass B no gradient)
                    with torch.no_grad():
                        head.weight.copy_(0.02 * torch.randn(head.weight.shape,
                                                             generator=torch.Generator().manual_seed(config.a_seed)))
                head.requires_grad_(config.head)
                params = bs + (list(head.parameters()) if config.head else [])
                opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config))
            ce = nn.functional.cross_entropy(head(feats), labels[idx])
            loss = ce + config.l1_lambda * l1_penalty(bs, config.l1_kind) if config.l1_lambda > 0 else ce
            if not bool(torch.isfinite(loss)):
                raise ValueError(f"the spec fine-tune diverged at step {step} (loss {float(loss.detach())}); lower "
                                    f"PaveConfig.lr (now {config.lr})")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            ces.append(float(ce.detach()))
    assert head is not None
    tensors = {f"{m}.lora_B": b.detach().clone().float() for m, _, b in factors}
    if config.head:
        tensors["head.weight"] = head.weight.detach().clone().float()
        tensors["head.bias"] = head.bias.detach().clone().float()
    info = {"n_examples": n, "steps": config.steps, "final_loss": losses[-1], "final_ce": ces[-1], "losses": losses,
            "seconds": time.perf_counter() - t0, "hidden_size": hidden_size}
    if base_model is not None:
        info["base_model"] = base_model
    return SpecFit(PaveSpec(tensors, config.to_dict(), fp, info), work, head, factors)


def _forward(model: nn.Module, inputs: Mapping[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Mean-pooled features (B, H) of the rows ``idx``, trailing all-padding positions trimmed."""
    mask = inputs["attention_mask"][idx]
    keep = int(mask.sum(1).max()) if mask.numel() else 0
    batch = {k: (v[idx][:, :keep] if v.ndim >= 2 and v.shape[1] == mask.shape[1] else v[idx]) for k, v in inputs.items()}
    hidden = _hidden(model(**batch))
    w = batch["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * w).sum(1) / w.sum(1).clamp_min(1.0)


def pave_spec(model: nn.Module, tokenizer: Any, texts: Sequence[str], labels: Sequence[int],
              config: PaveConfig | None = None, *, base_model: str | None = None) -> PaveSpec:
    """The PAVE spec of labelled texts on a Hugging Face encoder (``model(**tokenizer(...))``).

    Texts are tokenised once (truncated to ``config.max_length``, padded to the longest). Raises
    ``ValueError`` for empty data, a length mismatch, non-string texts or labels outside the head's classes.
    """
    config = config or PaveConfig()
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one str")
    texts = list(texts)
    labels = list(labels)
    if not texts:
        raise ValueError("empty data: a spec needs at least one labelled text")
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must contain only str")
    if not all(isinstance(y, numbers.Integral) and not isinstance(y, bool) for y in labels):
        raise ValueError("labels must be ints (class indices)")
    labels = [int(y) for y in labels]
    enc = tokenizer(texts, padding="longest", truncation=True, max_length=config.max_length, return_tensors="pt")
    inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    return spec_from_inputs(model, inputs, torch.tensor(labels, dtype=torch.long), config, base_model=base_model)
