"""DAF's entries in the shared adapter-contract matrix (loaded by tests/adapt/contract.py)."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


def cases(contract: Any) -> list:
    mod = "rankwise.adapt.daf"

    def case(name: str, **cfg: Any):
        def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
            from rankwise.adapt.daf import DAFConfig, adapt

            target: Any = nn.Linear if kind == "mlp" else ("query", "value")
            config = DAFConfig(rank=4, alpha=8.0, calib_batches=2, seed=seed, **cfg)
            calib, loss_fn = contract._calibration(kind, seed)
            return adapt(model, config, target=target, name=adapter, calib=calib, loss_fn=loss_fn)

        def bad_rank(model: nn.Module, kind: str) -> None:
            from rankwise.adapt.daf import DAFConfig, adapt

            target: Any = nn.Linear if kind == "mlp" else ("query", "value")
            calib, loss_fn = contract._calibration(kind, 0)
            adapt(model, DAFConfig(rank=10_000), target=target, calib=calib, loss_fn=loss_fn)

        api: Callable[[str], Callable[..., Any]] = lambda fn: contract._method_api(mod, fn)  # noqa: E731
        return contract.AdapterCase(name=name, apply=apply, merge=api("merge"), unmerge=api("unmerge"),
                                    disable=api("disable_adapters"), enable=api("enable_adapters"),
                                    set_active=api("set_active"), save=api("save_adapter"),
                                    load=api("load_adapter"), bad_rank=bad_rank)

    return [
        case("daf", budget_fraction=0.5),
        case("daf-score-skip-eval", budget_fraction=0.6, rank_by="score", fill="skip", analysis_train_mode=False),
    ]
