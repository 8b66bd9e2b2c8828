"""PAVE configuration: :class:`PaveConfig` (see :mod:`rankwise.science.pave`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from rankwise.core.validate import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_patterns,
    check_positive,
    check_unit,
)

__all__ = ["BACKENDS", "L1_KINDS", "SCHEDULES", "SPACE_FIELDS", "PaveConfig"]

L1_KINDS = ("induced", "elementwise")
SCHEDULES = ("cosine", "linear", "constant")
BACKENDS = ("rankwise", "peft")
#: The fields that define the space a spec lives in: two specs are comparable only when these agree.
SPACE_FIELDS = ("rank", "alpha", "target_modules", "layers", "a_seed", "num_labels", "head")


@dataclass(frozen=True)
class PaveConfig:
    """How a PAVE specification is computed (spec §1-§2; defaults: the reference recipe, CPU budget).

    Attributes:
        rank, alpha, dropout: the shared LoRA adapter (r = 16, alpha = 32, dropout 0.1 on its input).
        target_modules: module-name patterns of the adapted Linear layers (a bare name matches the
            last name component, as PEFT's ``target_modules``); BERT's ``query``/``key``/``value``.
        layers: adapt only the targets whose layer index (the first all-digit component of the module
            name, ``encoder.layer.4.attention.self.query`` -> 4) is listed; ``None``: every layer.
        train: ``"B_only"``: every ``lora_A`` is the frozen shared projection, only ``lora_B`` (and the
            head) train. The only mode (the paper's); a field so that the spec's metadata says it.
        steps, lr, batch_size, max_length: the fine-tuning budget (AdamW).
        schedule, warmup_ratio: learning-rate schedule after a linear warm-up of
            ``ceil(warmup_ratio * steps)`` steps (the reference: cosine, 3 %).
        weight_decay: AdamW's decoupled weight decay (0.5); max_grad_norm: gradient-norm clip (1.0).
        l1_lambda, l1_kind: the extra penalty ``(lambda / n_B) * sum_B ||B - B_before||_1``;
            ``"induced"`` = the matrix 1-norm (largest absolute column sum, the reference's call),
            ``"elementwise"`` = the sum of absolute entries.
        a_seed: seeds the shared A (each module's A is drawn from a generator seeded by ``a_seed`` and
            the module's name, so a layer's A does not depend on which other layers are adapted).
        seed: data order and dropout (the same for every spec that should be compared).
        num_labels: classes of the zero-initialised linear head (labels must lie in ``[0, num_labels)``).
        head: train a zero-initialised head together with B and include it in the spec (the CPU
            recipe's choice); ``False``: a fixed head N(0, 0.02^2) drawn from ``a_seed``, frozen, not stored.
        backend: ``"rankwise"`` (:func:`rankwise.core.lora.add_lora`) or ``"peft"``
            (``peft.inject_adapter_in_model``); both get the same shared A, and give the same spec.
        temperature: T of the score shown to users, ``100 * sigmoid(cos / T)``.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.1
    target_modules: tuple[str, ...] = ("query", "key", "value")
    layers: tuple[int, ...] | None = None
    train: str = "B_only"
    steps: int = 100
    lr: float = 1e-3
    batch_size: int = 16
    max_length: int = 64
    schedule: str = "cosine"
    warmup_ratio: float = 0.03
    weight_decay: float = 0.5
    max_grad_norm: float = 1.0
    l1_lambda: float = 1.0
    l1_kind: str = "induced"
    a_seed: int = 3407
    seed: int = 0
    num_labels: int = 2
    head: bool = True
    backend: str = "rankwise"
    temperature: float = 0.1

    def __post_init__(self) -> None:
        c = "PaveConfig"
        check_int(f"{c}.rank", self.rank, 1)
        object.__setattr__(self, "alpha", check_positive(f"{c}.alpha", self.alpha))
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))
        object.__setattr__(self, "target_modules", check_patterns(f"{c}.target_modules", self.target_modules))
        if self.layers is not None:
            if isinstance(self.layers, int) or not isinstance(self.layers, (tuple, list)) or not self.layers:
                raise ValueError(f"{c}.layers must be None or a non-empty tuple of ints >= 0, got {self.layers!r}")
            for i in self.layers:
                check_int(f"{c}.layers[]", i, 0)
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        check_choice(f"{c}.train", self.train, ("B_only",))
        check_int(f"{c}.steps", self.steps, 1)
        object.__setattr__(self, "lr", check_positive(f"{c}.lr", self.lr))
        check_int(f"{c}.batch_size", self.batch_size, 1)
        check_int(f"{c}.max_length", self.max_length, 2)
        check_choice(f"{c}.schedule", self.schedule, SCHEDULES)
        object.__setattr__(self, "warmup_ratio", check_unit(f"{c}.warmup_ratio", self.warmup_ratio, high_open=True))
        object.__setattr__(self, "weight_decay", check_number(f"{c}.weight_decay", self.weight_decay, 0.0))
        object.__setattr__(self, "max_grad_norm", check_positive(f"{c}.max_grad_norm", self.max_grad_norm))
        object.__setattr__(self, "l1_lambda", check_number(f"{c}.l1_lambda", self.l1_lambda, 0.0))
        check_choice(f"{c}.l1_kind", self.l1_kind, L1_KINDS)
        check_int(f"{c}.a_seed", self.a_seed, 0)
        check_int(f"{c}.seed", self.seed, 0)
        check_int(f"{c}.num_labels", self.num_labels, 2)
        check_bool(f"{c}.head", self.head)
        check_choice(f"{c}.backend", self.backend, BACKENDS)
        object.__setattr__(self, "temperature", check_positive(f"{c}.temperature", self.temperature))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PaveConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"PaveConfig: unknown field(s) {unknown}; known: {sorted(names)}")
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        return cls(**kw)

    def space(self) -> dict[str, Any]:
        """The fields of :data:`SPACE_FIELDS` (what must agree for two specs to be compared)."""
        full = self.to_dict()
        return {k: full[k] for k in SPACE_FIELDS}
