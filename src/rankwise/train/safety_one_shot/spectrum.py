"""The safety gradient, its spectrum and the projection onto its top directions (spec steps 4-6).

Pure functions on named tensors (no training loop):

* :func:`example_pair` / :func:`encode_examples`: a safety example (a harmful prompt and a refusal) as
  ``(prompt, response)`` and as a right-padded batch whose labels cover the response (+ EOS) only;
* :func:`safety_nll`: the token-mean NLL ``l_s`` of the responses given the prompts;
* :func:`safety_gradient`: ``G_l = d l_s / d W_l`` for every trainable 2-D weight (step 4);
* :func:`energy_ratios`, :func:`gradient_spectrum`, :func:`safety_gradient_spectrum`: singular values,
  ``e_l(k) = sum_{j<=k} s_j^2 / sum_j s_j^2`` and the effective rank ``exp(H(s^2 / sum s^2))``
  (``core.linalg.effective_rank`` of the vector ``s^2``);
* :func:`top_subspaces`, :func:`project_update`: ``U_k U_k^T dW V_k V_k^T`` (step 5), with a warning
  when ``k`` exceeds a layer's ``min(d_out, d_in)``;
* :func:`flat_cosine`, :func:`gradient_antagonism`: ``cos(vec G, vec Delta_h)`` over all 2-D weights
  and per layer (step 6).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from rankwise.core.errors import NumericalError
from rankwise.core.linalg import effective_rank
from rankwise.core.lmdata import IGNORE_INDEX, LMBatch, collate, encode_pair

__all__ = [
    "DEFAULT_KS",
    "LayerSpectrum",
    "SafetySpectrum",
    "encode_examples",
    "energy_ratios",
    "example_pair",
    "flat_cosine",
    "gradient_antagonism",
    "gradient_spectrum",
    "matrix_parameters",
    "project_update",
    "safety_gradient",
    "safety_gradient_spectrum",
    "safety_nll",
    "top_subspaces",
]

DEFAULT_KS: tuple[int, ...] = (1, 2, 4, 8, 16)


def example_pair(example: Any) -> tuple[str, str]:
    """``(prompt, response)`` of an example: an object with ``.prompt`` and ``.completion`` or ``.response``,
    a mapping with ``"prompt"`` and ``"response"`` (or ``"completion"``), or a 2-tuple. Raises ValueError
    for an empty prompt or response (a response with no target token cannot teach a refusal)."""
    if isinstance(example, Mapping):
        keys = [k for k in ("response", "completion") if k in example]
        if "prompt" not in example or not keys:
            raise ValueError(f"a safety example needs the keys 'prompt' and 'response' (or 'completion'), "
                             f"got {sorted(map(str, example))}")
        prompt, response = example["prompt"], example[keys[0]]
    elif hasattr(example, "prompt") and (hasattr(example, "completion") or hasattr(example, "response")):
        prompt = example.prompt
        response = example.completion if hasattr(example, "completion") else example.response
    elif isinstance(example, (tuple, list)) and len(example) == 2:
        prompt, response = example
    else:
        raise TypeError(f"a safety example is a (prompt, response) pair, a dict or an object with .prompt and "
                        f".completion; got {type(example).__name__}")
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise TypeError(f"prompt and response must be str, got {type(prompt).__name__}, {type(response).__name__}")
    if not response.strip():
        raise ValueError(f"the safety example for prompt {prompt!r:.60} has an empty response: no target token "
                         "to train on")
    if not prompt.strip():
        raise ValueError("the safety example has an empty prompt")
    return prompt, response


def encode_examples(tokenizer: Any, examples: Sequence[Any], add_eos: bool = True, repeat: int = 1) -> LMBatch:
    """A batch of the examples (each ``repeat`` times), labels -100 on prompts and padding."""
    if isinstance(examples, (str, bytes, Mapping)) or not isinstance(examples, Sequence) or not examples:
        raise ValueError("examples must be a non-empty sequence of safety examples")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token")
    encoded = []
    for e in examples:
        prompt, response = example_pair(e)
        ids, plen = encode_pair(tokenizer, prompt, response, add_eos)
        if len(ids) == plen:
            raise ValueError(f"the response of {prompt!r:.60} tokenizes to nothing: no target token")
        encoded += [(ids, plen)] * repeat
    return collate(encoded, pad, mask_prompt=True)


def safety_nll(model: nn.Module, batch: LMBatch) -> torch.Tensor:
    """Token-mean NLL of the batch's target tokens (``l_s``; fp32), with gradient."""
    dev = next(iter(model.parameters())).device
    logits = model(input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev)).logits
    labels = batch.labels[:, 1:].to(dev)
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       ignore_index=IGNORE_INDEX)


def matrix_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable 2-D weights of ``model`` by name (the ``W_l`` of the spec)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2}


def safety_gradient(model: nn.Module, tokenizer: Any, examples: Any, add_eos: bool = True
                    ) -> dict[str, torch.Tensor]:
    """``G_l = d l_s / d W_l`` (fp32, detached) for every trainable 2-D weight; the model's ``.grad`` are
    untouched. ``examples``: one example or a sequence of them (their mean loss)."""
    batch = encode_examples(tokenizer, _as_list(examples), add_eos)
    params = matrix_parameters(model)
    if not params:
        raise ValueError("the model has no trainable 2-D weight")
    was = model.training
    model.eval()
    try:
        loss = safety_nll(model, batch)
        if not torch.isfinite(loss):
            raise NumericalError(f"the safety loss is {float(loss)} at these weights")
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    finally:
        model.train(was)
    return {n: (torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float())
            for (n, p), g in zip(params.items(), grads)}


def _as_list(examples: Any) -> list[Any]:
    if isinstance(examples, list) or (isinstance(examples, tuple) and not (
            len(examples) == 2 and all(isinstance(x, str) for x in examples))):
        return list(examples)
    return [examples]


def energy_ratios(s: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """``e(k) = sum_{j<=k} s_j^2 / sum_j s_j^2`` for each k (singular values in descending order; k is
    clamped to ``len(s)``; the zero spectrum gives 1.0: nothing is left outside the top k)."""
    e = s.double() ** 2
    total = float(e.sum())
    cum = torch.cumsum(e, 0)
    out = {}
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"energy ratios: every k must be an int >= 1, got {k!r}")
        out[k] = 1.0 if total <= 0 else float(cum[min(k, len(s)) - 1] / total)
    return out


@dataclass
class LayerSpectrum:
    """One weight's safety-gradient spectrum: ``singular_values`` (descending), ``energy`` (k -> e(k)),
    ``effective_rank`` (``exp`` of the entropy of ``s^2 / sum s^2``), the matrix ``shape``."""

    singular_values: torch.Tensor
    energy: dict[int, float]
    effective_rank: float
    shape: tuple[int, int]


@dataclass
class SafetySpectrum:
    """Per-layer spectra of one example's gradient; ``n_target_tokens`` (loss positions) and
    ``n_positions`` (sequence length, the trivial bound on each gradient's rank)."""

    layers: dict[str, LayerSpectrum]
    n_target_tokens: int
    n_positions: int
    ks: tuple[int, ...] = field(default=DEFAULT_KS)

    def share_low_rank(self, k: int, energy: float = 0.9) -> float:
        """Share of layers whose top-k singular values hold at least ``energy`` of the gradient's."""
        vals = [energy_ratios(sp.singular_values, [k])[k] >= energy for sp in self.layers.values()]
        return sum(vals) / len(vals) if vals else float("nan")

    def median_effective_rank(self) -> float:
        return float(torch.tensor([sp.effective_rank for sp in self.layers.values()]).median())

    def __getitem__(self, name: str) -> LayerSpectrum:
        return self.layers[name]


def gradient_spectrum(grads: Mapping[str, torch.Tensor], ks: Sequence[int] = DEFAULT_KS) -> dict[str, LayerSpectrum]:
    """SVD spectrum of each gradient matrix (float64)."""
    out = {}
    for n, g in grads.items():
        if g.ndim != 2:
            raise ValueError(f"gradient_spectrum: {n} is not a matrix (shape {tuple(g.shape)})")
        if not bool(torch.isfinite(g).all()):
            raise NumericalError(f"gradient_spectrum: the gradient of {n} holds NaN or inf")
        s = torch.linalg.svdvals(g.double())
        er = effective_rank(s ** 2) if float(s.sum()) > 0 else 0.0
        out[n] = LayerSpectrum(s, energy_ratios(s, ks), er, (int(g.shape[0]), int(g.shape[1])))
    return out


def safety_gradient_spectrum(model: nn.Module, tokenizer: Any, example: Any, ks: Sequence[int] = DEFAULT_KS,
                             add_eos: bool = True) -> SafetySpectrum:
    """Spectrum of the one-example safety gradient at the model's current weights (spec step 4)."""
    ks = tuple(ks)
    batch = encode_examples(tokenizer, [example], add_eos)
    grads = safety_gradient(model, tokenizer, example, add_eos)
    return SafetySpectrum(gradient_spectrum(grads, ks), int((batch.labels[:, 1:] != IGNORE_INDEX).sum()),
                          int(batch.input_ids.shape[1]), ks)


def top_subspaces(grads: Mapping[str, torch.Tensor], rank: int
                  ) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``name -> (U, V)``: the top-``rank`` left and right singular vectors of each gradient (its dtype).

    Each side keeps ``min(rank, dim)`` vectors of the full singular basis; a side whose ``rank`` covers
    its whole dimension is ``None`` (the identity, skipped by :func:`project_update`), so a rank at or
    above ``max(d_out, d_in)`` reproduces the plain update bit for bit. ``rank`` above a layer's
    ``min(d_out, d_in)`` (the gradient's largest possible rank) warns once, naming the layers;
    ``rank <= 0`` raises ValueError."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"projection rank must be an int >= 1, got {rank!r}")
    out: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    clamped = []
    for n, g in grads.items():
        d_out, d_in = g.shape
        if rank > min(d_out, d_in):
            clamped.append(f"{n} ({min(d_out, d_in)})")
        if rank >= max(d_out, d_in):
            out[n] = (None, None)
            continue
        full = rank > min(d_out, d_in)  # the longer side needs more than the thin SVD's vectors
        U, _, Vh = torch.linalg.svd(g.double(), full_matrices=full)
        out[n] = (None if rank >= d_out else U[:, :rank].to(g.dtype).contiguous(),
                  None if rank >= d_in else Vh[:rank].T.to(g.dtype).contiguous())
    if clamped:
        warnings.warn(f"projection rank {rank} exceeds min(d_out, d_in) of {len(clamped)} weight(s), so it "
                      f"covers every direction of their gradient: {', '.join(clamped[:6])}"
                      f"{' ...' if len(clamped) > 6 else ''}", stacklevel=2)
    return out


def project_update(dW: torch.Tensor, U: torch.Tensor | None, V: torch.Tensor | None) -> torch.Tensor:
    """``U U^T dW V V^T`` (``U`` ``(d_out, k_out)``, ``V`` ``(d_in, k_in)`` with orthonormal columns; a
    ``None`` side is the identity)."""
    if dW.ndim != 2 or (U is not None and U.shape[0] != dW.shape[0]) or (V is not None and V.shape[0] != dW.shape[1]):
        raise ValueError(f"project_update: dW {tuple(dW.shape)}, U {None if U is None else tuple(U.shape)}, "
                         f"V {None if V is None else tuple(V.shape)} do not fit")
    out = dW
    if U is not None:
        U = U.to(dW.dtype)
        out = U @ (U.T @ out)
    if V is not None:
        V = V.to(dW.dtype)
        out = (out @ V) @ V.T
    return out


def flat_cosine(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Cosine of the concatenated (flattened, float64) tensors over the names of ``a`` (all must be in ``b``)."""
    missing = sorted(set(a) - set(b))
    if missing:
        raise KeyError(f"flat_cosine: {len(missing)} name(s) missing from the second set: {missing[:5]}")
    dot = na = nb = 0.0
    for n, x in a.items():
        x, y = x.double().reshape(-1), b[n].double().reshape(-1).to(x.device)
        dot += float(x @ y)
        na += float(x @ x)
        nb += float(y @ y)
    if na <= 0 or nb <= 0:
        return 0.0
    return dot / math.sqrt(na * nb)


def gradient_antagonism(grads: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
                        ) -> tuple[float, dict[str, float]]:
    """``(cos over all layers, {layer: cos})`` of the safety gradient ``G`` with the harmful update
    ``Delta_h = theta_h - theta_0`` (spec step 6: positive means the descent step ``-G`` undoes part of
    ``Delta_h``)."""
    return flat_cosine(grads, delta), {n: flat_cosine({n: g}, {n: delta[n]}) for n, g in grads.items()}
