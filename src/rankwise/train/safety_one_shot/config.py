"""Configuration of the one-example safety patch (spec "Method", steps 2, 3 and 5)."""

from __future__ import annotations

from dataclasses import dataclass

from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive

__all__ = ["SELECTION_RULES", "SafetyPatchConfig"]

SELECTION_RULES: tuple[str, ...] = ("antagonism", "random", "loss")


@dataclass(frozen=True)
class SafetyPatchConfig:
    """Hyper-parameters of :class:`~rankwise.train.safety_one_shot.OneShotSafetyPatch`.

    Attributes:
        epochs: optimizer steps on the safety example (one epoch = one step; spec E = 10). 0 is allowed
            and returns the model unchanged.
        lr: learning rate (spec choice: 1e-3 for tiny models, 2e-5 for 1B+ models).
        optimizer: ``"adamw"`` (default) or ``"sgd"`` (plain gradient descent).
        weight_decay: AdamW's decoupled weight decay (0: the patch moves only along the loss).
        projection_rank: ``None`` for the plain patch; ``k >= 1`` for the projected patch: every step's
            update of a 2-D weight ``W`` becomes ``U_k U_k^T dW V_k V_k^T``, with ``U_k, V_k`` the top-k
            singular vectors of the safety gradient at the starting weights (each side keeps
            ``min(k, dim)`` vectors; ``k`` above a layer's ``min(d_out, d_in)`` warns; ``k >=
            max(d_out, d_in)`` is the plain update).
        stop_nll: stop early once the safety example's token-mean NLL is below this (spec: 0.05); None
            runs every epoch.
        repeat: copies of the example in each step's batch (spec: "optionally repeated in a batch").
        grad_clip: global gradient-norm clip (None: no clip).
        add_eos: the response is followed by EOS, which is then a target token.
    """

    epochs: int = 10
    lr: float = 1e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    projection_rank: int | None = None
    stop_nll: float | None = 0.05
    repeat: int = 1
    grad_clip: float | None = None
    add_eos: bool = True

    def __post_init__(self) -> None:
        check_int("SafetyPatchConfig.epochs", self.epochs, 0)
        check_positive("SafetyPatchConfig.lr", self.lr)
        check_choice("SafetyPatchConfig.optimizer", self.optimizer, ("adamw", "sgd"))
        check_number("SafetyPatchConfig.weight_decay", self.weight_decay, 0.0)
        if self.projection_rank is not None and (isinstance(self.projection_rank, bool)
                                                 or not isinstance(self.projection_rank, int)
                                                 or self.projection_rank <= 0):
            raise ValueError(f"SafetyPatchConfig.projection_rank must be None or an int >= 1, "
                             f"got {self.projection_rank!r}")
        check_positive("SafetyPatchConfig.stop_nll", self.stop_nll, allow_none=True)
        check_int("SafetyPatchConfig.repeat", self.repeat, 1)
        check_positive("SafetyPatchConfig.grad_clip", self.grad_clip, allow_none=True)
        check_bool("SafetyPatchConfig.add_eos", self.add_eos)
