"""LoRA configuration: :class:`LoraConfig` (see :mod:`rankwise.adapt.lora`)."""

from __future__ import annotations

from dataclasses import dataclass

from rankwise.core.lora import INITS
from rankwise.core.validate import check_bool, check_choice, check_int, check_positive, check_unit


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (defaults: the reference/PEFT ones for BERT-style models).

    Attributes:
        rank: r >= 1, the inner dimension of B A (Hu et al. Sec. 4.1).
        alpha: the scaling numerator; s = alpha / r (or alpha / sqrt(r) with ``use_rslora``).
        dropout: dropout on the adapter's input, in [0, 1).
        use_rslora: rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski, 2023).
        target: module-name patterns (see :func:`rankwise.core.select.select`); a bare name
            matches the last component, as PEFT's ``target_modules`` does.
        init: "kaiming" (A ~ kaiming-uniform(a=sqrt 5), PEFT's default) or "gaussian" (A ~ N(0, 1/r^2));
            B = 0 either way, so the adapted model starts equal to the base model.
        seed: seeds the initialisation (``None``: the global torch RNG).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    use_rslora: bool = False
    target: tuple[str, ...] = ("query", "value")
    init: str = "kaiming"
    seed: int | None = 0

    def __post_init__(self) -> None:
        c = "LoraConfig"
        check_int(f"{c}.rank", self.rank, 1)
        object.__setattr__(self, "alpha", check_positive(f"{c}.alpha", self.alpha))
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))
        check_bool(f"{c}.use_rslora", self.use_rslora)
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError(f"{c}.target must be a non-empty tuple of module-name patterns, "
                             f"got {self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        check_choice(f"{c}.init", self.init, INITS)
        check_int(f"{c}.seed", self.seed, allow_none=True)
