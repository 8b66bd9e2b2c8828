"""The one-example safety patch, its multi-example baseline and the auditable weight delta.

    patcher = OneShotSafetyPatch(model, tokenizer, SafetyPatchConfig(epochs=10, lr=1e-3))
    example = patcher.select_example(candidates, reference_state=aligned_state_dict)
    patched = patcher.patch(example)          # a new model; the original is untouched (inplace=False)
    patcher.save("patch.safetensors")         # theta_patched - theta_h, with its metadata

The patch (spec steps 2-3, 5): ``epochs`` optimizer steps on the token-mean NLL of the response given
the prompt, checked before each step: it stops early once the NLL is below ``stop_nll``; a non-finite
loss or weight restores the pre-patch weights and raises :class:`~rankwise.core.errors.NumericalError`.
With ``projection_rank=k`` every step's update ``dW`` of a trainable 2-D weight is replaced by
``U_k U_k^T dW V_k V_k^T`` (top-k singular vectors of the safety gradient at the starting weights);
other trainable tensors (norm gains, biases) keep their plain update. Only parameters with
``requires_grad`` move, so a PEFT/LoRA model is patched in its adapter only. The model runs in eval
mode during the patch (no dropout: the steps are deterministic).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from rankwise.core.errors import ArtifactError, NumericalError
from rankwise.core.io import check_fingerprint, load_tensors, model_fingerprint, save_tensors
from rankwise.train.safety_one_shot.config import SELECTION_RULES, SafetyPatchConfig
from rankwise.train.safety_one_shot.spectrum import (
    encode_examples,
    example_pair,
    flat_cosine,
    matrix_parameters,
    project_update,
    safety_gradient,
    safety_nll,
    top_subspaces,
)

__all__ = ["DELTA_METHOD", "MultiExampleSafetyPatch", "OneShotSafetyPatch", "PatchResult", "apply_delta",
           "load_delta"]

DELTA_METHOD = "safety_one_shot"


@dataclass
class PatchResult:
    """What a patch did: ``losses[i]`` the safety NLL before step i (the last entry is the NLL after the
    final step), ``steps`` taken, ``stopped_early``, ``wall_time_s``, ``n_examples``."""

    losses: list[float] = field(default_factory=list)
    steps: int = 0
    stopped_early: bool = False
    wall_time_s: float = 0.0
    n_examples: int = 1

    @property
    def final_nll(self) -> float:
        return self.losses[-1] if self.losses else float("nan")


class OneShotSafetyPatch:
    """Patch a (harmfully fine-tuned) causal LM with ONE safety example (a harmful prompt + a refusal).

    ``model``: any causal LM whose forward takes ``input_ids``/``attention_mask`` and returns
    ``.logits``; ``tokenizer``: its tokenizer (a pad or EOS token is needed). After :meth:`patch`,
    :attr:`delta` holds ``theta_patched - theta_h`` for every trainable tensor, :attr:`result` the
    losses, and :meth:`save` writes the delta (safetensors, float64 so that re-applying it to
    ``theta_h`` reproduces the patched weights) with the config, the example and the base model's
    fingerprint.
    """

    _max_examples: int | None = 1

    def __init__(self, model: nn.Module, tokenizer: Any, config: SafetyPatchConfig | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        config = SafetyPatchConfig() if config is None else config
        if not isinstance(config, SafetyPatchConfig):
            raise TypeError(f"config must be a SafetyPatchConfig, got {type(config).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameter (every requires_grad is False)")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.delta: dict[str, torch.Tensor] = {}
        self.result: PatchResult | None = None
        self.examples: list[tuple[str, str]] = []
        self.selection_scores: list[float] = []
        self._base_fingerprint: str | None = None

    # -- selection ---------------------------------------------------------------------------------

    def select_example(self, candidates: Sequence[Any], reference_state: Mapping[str, torch.Tensor] | None = None,
                       rule: str = "antagonism", seed: int = 0) -> Any:
        """Pick one safety example from ``candidates`` (a library choice; the paper's rule is not known).

        * ``"antagonism"`` (default; needs ``reference_state``, the aligned model's state dict): the
          candidate whose descent direction ``-G`` at the current weights has the largest cosine with
          ``theta_0 - theta_h`` over all trainable 2-D weights (the step that best points back to the
          aligned weights);
        * ``"loss"``: the candidate with the largest safety NLL at the current weights;
        * ``"random"``: uniform, from ``seed``.

        ``selection_scores`` keeps each candidate's score (cosine, NLL, or 0 for random).
        """
        if rule not in SELECTION_RULES:
            raise ValueError(f"select_example: rule must be one of {SELECTION_RULES}, got {rule!r}")
        if isinstance(candidates, (str, bytes, Mapping)) or not isinstance(candidates, Sequence) or not candidates:
            raise ValueError("select_example: candidates must be a non-empty sequence of safety examples")
        for c in candidates:
            example_pair(c)
        if rule == "random":
            i = int(torch.randint(0, len(candidates), (1,), generator=torch.Generator().manual_seed(seed)))
            self.selection_scores = [1.0 if j == i else 0.0 for j in range(len(candidates))]
            return candidates[i]
        if rule == "loss":
            was = self.model.training
            self.model.eval()
            try:
                with torch.no_grad():
                    scores = [float(self._nll(encode_examples(self.tokenizer, [c], self.config.add_eos)))
                              for c in candidates]
            finally:
                self.model.train(was)
        else:
            if reference_state is None:
                raise ValueError("select_example(rule='antagonism') needs reference_state (the aligned model's "
                                 "state dict); pass rule='random' or 'loss' to choose without it")
            back = self._toward(reference_state)
            scores = [flat_cosine({n: -g for n, g in safety_gradient(self.model, self.tokenizer, c,
                                                                     self.config.add_eos).items()}, back)
                      for c in candidates]
        self.selection_scores = scores
        return candidates[max(range(len(scores)), key=scores.__getitem__)]

    def _toward(self, reference_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``theta_0 - theta_h`` for every trainable 2-D weight; raises ValueError listing bad keys."""
        if not isinstance(reference_state, Mapping):
            raise TypeError(f"reference_state must be a state dict, got {type(reference_state).__name__}")
        params = matrix_parameters(self.model)
        known = set(self.model.state_dict())
        missing = sorted(n for n in params if n not in reference_state)
        unexpected = sorted(n for n in reference_state if n not in known)
        shape = sorted(f"{n} {tuple(reference_state[n].shape)} vs {tuple(p.shape)}" for n, p in params.items()
                       if n in reference_state and tuple(reference_state[n].shape) != tuple(p.shape))
        if missing or unexpected or shape:
            parts = [f"{what}: {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}" for what, v in
                     (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", shape)) if v]
            raise ValueError("reference_state does not match the model (" + "; ".join(parts) + ")")
        return {n: reference_state[n].detach().to(p.device, torch.float64) - p.detach().double()
                for n, p in params.items()}

    # -- the patch ---------------------------------------------------------------------------------

    def _nll(self, batch: Any, model: nn.Module | None = None) -> torch.Tensor:
        return safety_nll(self.model if model is None else model, batch)

    def _pairs(self, examples: Any) -> list[tuple[str, str]]:
        if isinstance(examples, (list, tuple)) and examples and not (
                isinstance(examples, tuple) and len(examples) == 2 and all(isinstance(x, str) for x in examples)):
            items = list(examples)
        else:
            items = [examples]
        if self._max_examples is not None and len(items) > self._max_examples:
            raise ValueError(f"OneShotSafetyPatch takes one safety example, got {len(items)}; use "
                             "MultiExampleSafetyPatch for the multi-example baseline")
        return [example_pair(e) for e in items]

    def patch(self, example: Any, inplace: bool = False) -> nn.Module:
        """Run the patch on ``example``; returns the patched model (a deep copy unless ``inplace``)."""
        pairs = self._pairs(example)
        model = self.model if inplace else copy.deepcopy(self.model)
        self._base_fingerprint = model_fingerprint(model)
        self.result = self._run(model, pairs)
        self.examples = pairs
        return model

    def _batches(self, pairs: list[tuple[str, str]]) -> list[Any]:
        return [encode_examples(self.tokenizer, pairs, self.config.add_eos, self.config.repeat)]

    def _run(self, model: nn.Module, pairs: list[tuple[str, str]]) -> PatchResult:
        cfg = self.config
        t0 = time.perf_counter()
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        before = {n: p.detach().clone() for n, p in params.items()}
        batches = self._batches(pairs)
        subspaces = {}
        if cfg.projection_rank is not None:
            subspaces = top_subspaces(safety_gradient(model, self.tokenizer, pairs, cfg.add_eos), cfg.projection_rank)
        if cfg.optimizer == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            opt = torch.optim.SGD(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
        res = PatchResult(n_examples=len(pairs))
        was = model.training
        model.eval()

        def restore(why: str) -> None:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(before[n])
            raise NumericalError(f"safety patch: {why}; the pre-patch weights were restored (lower the "
                                 "learning rate or check the model)")

        def epoch_loss(with_grad: bool) -> float:
            total = 0.0
            for b in batches:
                with torch.set_grad_enabled(with_grad):
                    loss = self._nll(b, model)
                if not torch.isfinite(loss):
                    restore(f"the safety loss is {float(loss.detach())} at step {res.steps}")
                if with_grad:
                    (loss * (len(b) / sum(len(x) for x in batches))).backward()
                total += float(loss.detach()) * len(b)
            return total / sum(len(x) for x in batches)

        try:
            for _ in range(cfg.epochs):
                opt.zero_grad(set_to_none=True)
                single = len(batches) == 1
                loss = epoch_loss(single)  # the NLL before this epoch (with its gradient for one batch)
                if cfg.stop_nll is not None and loss < cfg.stop_nll:
                    res.losses.append(loss)
                    res.stopped_early = True
                    break
                if single:
                    self._step(model, opt, params, subspaces, restore, res)
                else:  # the multi-example baseline in several batches: one optimizer step per batch
                    self._epoch_multi(model, batches, opt, subspaces, restore, res)
                res.losses.append(loss)
            else:
                res.losses.append(epoch_loss(False))
        finally:
            opt.zero_grad(set_to_none=True)
            model.train(was)
        self.delta = {n: p.detach().double() - before[n].double() for n, p in params.items()}
        res.wall_time_s = time.perf_counter() - t0
        return res

    def _step(self, model: nn.Module, opt: torch.optim.Optimizer, params: dict[str, nn.Parameter],
              subspaces: dict[str, tuple[torch.Tensor, torch.Tensor]], restore: Any, res: PatchResult) -> None:
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), self.config.grad_clip)
        olds = {n: params[n].detach().clone() for n, uv in subspaces.items() if any(x is not None for x in uv)}
        try:
            opt.step()
        except RuntimeError as e:  # e.g. an overflow inside the optimizer at an absurd learning rate
            restore(f"the optimizer step {res.steps} failed ({' '.join(str(e).split())[:120]})")
        res.steps += 1
        with torch.no_grad():
            for n, (U, V) in subspaces.items():
                if U is not None or V is not None:
                    p = params[n]
                    p.copy_(olds[n] + project_update(p - olds[n], U, V))
        bad = [n for n, p in params.items() if not bool(torch.isfinite(p).all())]
        if bad:
            restore(f"non-finite weights after step {res.steps} in {', '.join(bad[:4])}")

    def _epoch_multi(self, model: nn.Module, batches: list[Any], opt: torch.optim.Optimizer,
                     subspaces: Any, restore: Any, res: PatchResult) -> None:
        raise NotImplementedError  # pragma: no cover - MultiExampleSafetyPatch overrides

    # -- the artefact ------------------------------------------------------------------------------

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write :attr:`delta` (float64 unless ``dtype``) and its metadata to ``path`` (atomic)."""
        if self.result is None:
            raise RuntimeError("nothing to save: call patch() first")
        tensors = {n: (d if dtype is None else d.to(dtype)) for n, d in self.delta.items()}
        meta = {"method": DELTA_METHOD, "config": dataclasses.asdict(self.config),
                "examples": [{"prompt": p, "response": r} for p, r in self.examples],
                "losses": self.result.losses, "steps": self.result.steps, "stopped_early": self.result.stopped_early,
                "fingerprint": self._base_fingerprint}
        return save_tensors(path, tensors, meta)


class MultiExampleSafetyPatch(OneShotSafetyPatch):
    """The multi-example baseline: the same procedure on ``n`` safety examples.

    Each epoch is one pass over the examples in batches of ``batch_size`` (None: all in one batch, so
    an epoch is one optimizer step, the one-shot patch's budget in steps). Early stopping looks at the
    mean NLL over the examples before each epoch."""

    _max_examples = None

    def __init__(self, model: nn.Module, tokenizer: Any, config: SafetyPatchConfig | None = None,
                 batch_size: int | None = None) -> None:
        super().__init__(model, tokenizer, config)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"MultiExampleSafetyPatch.batch_size must be None or an int >= 1, got {batch_size!r}")
        self.batch_size = batch_size

    def select_example(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("MultiExampleSafetyPatch uses every example it is given; select with OneShotSafetyPatch")

    def _batches(self, pairs: list[tuple[str, str]]) -> list[Any]:
        bs = len(pairs) if self.batch_size is None else self.batch_size
        return [encode_examples(self.tokenizer, pairs[i:i + bs], self.config.add_eos, self.config.repeat)
                for i in range(0, len(pairs), bs)]

    def _epoch_multi(self, model: nn.Module, batches: list[Any], opt: torch.optim.Optimizer,
                     subspaces: Any, restore: Any, res: PatchResult) -> None:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for b in batches:
            opt.zero_grad(set_to_none=True)
            loss = self._nll(b, model)
            if not torch.isfinite(loss):
                restore(f"the safety loss is {float(loss.detach())} at step {res.steps}")
            loss.backward()
            self._step(model, opt, params, subspaces, restore, res)


def load_delta(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(delta tensors, metadata)`` of a file written by :meth:`OneShotSafetyPatch.save` (checked)."""
    tensors, meta = load_tensors(path)
    if meta.get("method") != DELTA_METHOD:
        raise ArtifactError(f"{path}: not a safety-patch delta (method {meta.get('method')!r})")
    return tensors, meta


def apply_delta(model: nn.Module, delta: Mapping[str, torch.Tensor] | str | Path, alpha: float = 1.0,
                check_base: bool = True) -> nn.Module:
    """Add ``alpha * delta`` to the model's parameters in place (computed in float64, cast back).

    ``delta``: a dict or a file from :meth:`OneShotSafetyPatch.save`; with a file and ``check_base``,
    the model must be the one the delta was computed on (its fingerprint). Every name and shape is
    checked before any weight changes."""
    if isinstance(delta, (str, Path)):
        delta, meta = load_delta(delta)
        if check_base:
            check_fingerprint(meta.get("fingerprint"), model, source="the safety-patch delta")
    params = dict(model.named_parameters())
    missing = sorted(n for n in delta if n not in params)
    shape = sorted(n for n in delta if n in params and tuple(params[n].shape) != tuple(delta[n].shape))
    if missing or shape:
        raise ValueError(f"the delta does not fit the model: unknown parameters {missing[:8]}, shape mismatch "
                         f"{shape[:8]}")
    with torch.no_grad():
        for n, d in delta.items():
            p = params[n]
            p.copy_((p.double() + alpha * d.to(p.device, torch.float64)).to(p.dtype))
    return model
