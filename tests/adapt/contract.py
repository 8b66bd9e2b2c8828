"""The shared adapter contract: one record per adapter, checked by ``test_adapter_contract.py``.

To put a new adapter under the contract, append one :class:`AdapterCase` to :data:`ADAPTERS` (and
nothing else): a function that applies it to a tiny model, plus the optional operations it supports.
A capability left as ``None`` skips the tests that need it (the skip reason names it), so the
matrix shows at a glance what each adapter supports.

The tiny models (built inline, never from ``rankwise.zoo``): ``"mlp"`` is an ``nn.Sequential`` of
three Linear layers (16 -> 32 -> 32 -> 8), ``"bert"`` a 2-layer ``transformers.BertModel`` (hidden
32, 4 heads), both built from a fixed seed in eval mode. ``forward(model, kind)`` runs one fixed
batch and returns a tensor.

This module is loaded by ``tests/adapt/conftest.py`` under the unique module name
``rankwise_tests_adapt_contract`` (so it works under any pytest import mode and with xdist);
test modules import it by that name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

KINDS = ("mlp", "bert")


# ---------------------------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------------------------

def tiny_bert_config(hidden: int = 32, layers: int = 2):
    from transformers import BertConfig

    return BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=2 * hidden, vocab_size=100, max_position_embeddings=32,
                      hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


def tiny_model(kind: str, seed: int = 0, hidden: int = 32) -> nn.Module:
    """A small model of ``kind`` ("mlp" or "bert"), weights drawn from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    if kind == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                         nn.Linear(hidden, 8))
    elif kind == "bert":
        from transformers import BertModel

        model = BertModel(tiny_bert_config(hidden))
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use one of {KINDS}")
    return model.eval()


def inputs(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    if kind == "mlp":
        return torch.randn(4, 16, generator=g)
    return torch.randint(0, 100, (2, 8), generator=g)


@torch.no_grad()
def forward(model: nn.Module, kind: str, x: torch.Tensor | None = None) -> torch.Tensor:
    x = inputs(kind) if x is None else x
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


@torch.no_grad()
def perturb_trainable(model: nn.Module, seed: int, std: float = 0.1) -> None:
    """Stand-in for training: add N(0, std^2) noise to every trainable parameter (in model order)."""
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        if p.requires_grad:
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)


# ---------------------------------------------------------------------------------------------
# the record
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdapterCase:
    """What the contract needs to know about one adapter.

    Required:
        name: test id.
        apply: ``apply(model, kind, name, seed) -> model`` adds adapter ``name`` (initialised from
            ``seed``) to a tiny model of ``kind``; the new adapter is the active and only trainable one.
    Optional capabilities (``None`` = not supported; the matching tests are skipped):
        merge / unmerge: ``f(model)``; merging twice must raise ``RankwiseError``.
        disable / enable: ``f(model)``; disabled means the base model's outputs.
        set_active: ``f(model, name)``; selects one of several named adapters.
        save / load: ``save(model, dir, name)`` writes an artefact directory; ``load(model, dir, name)``
            loads it into a model that ``apply`` prepared; the round trip must be bit-exact, and a
            corrupt file must raise ``ArtifactError`` and leave the model unchanged.
        bad_rank: ``f(model, kind)`` applies the adapter with an impossible rank/size; must raise
            ``ValueError`` and leave the model unchanged.
    Flags:
        kinds: tiny models the adapter applies to.
        identity_at_init: the adapted model equals the base model before training.
        freezes_base: every parameter of the base model is frozen after ``apply``.
        checks_base: ``load`` rejects an artefact saved for another base model (ArtifactError).
        merge_atol: tolerance of merged vs unmerged outputs.
        perturb: ``f(model, seed)`` stands in for training (default: noise on trainable parameters).
    """

    name: str
    apply: Callable[[nn.Module, str, str, int], nn.Module]
    kinds: tuple[str, ...] = KINDS
    merge: Callable[[nn.Module], Any] | None = None
    unmerge: Callable[[nn.Module], Any] | None = None
    disable: Callable[[nn.Module], Any] | None = None
    enable: Callable[[nn.Module], Any] | None = None
    set_active: Callable[[nn.Module, str], Any] | None = None
    save: Callable[[nn.Module, Path, str], Any] | None = None
    load: Callable[[nn.Module, Path, str], Any] | None = None
    bad_rank: Callable[[nn.Module, str], Any] | None = None
    identity_at_init: bool = True
    freezes_base: bool = True
    checks_base: bool = True
    merge_atol: float = 1e-5
    perturb: Callable[[nn.Module, int], None] = perturb_trainable

    @property
    def supports_merge(self) -> bool:
        return self.merge is not None and self.unmerge is not None

    @property
    def supports_disable(self) -> bool:
        return self.disable is not None and self.enable is not None

    @property
    def supports_multiple(self) -> bool:
        return self.set_active is not None

    @property
    def supports_save(self) -> bool:
        return self.save is not None and self.load is not None


# ---------------------------------------------------------------------------------------------
# entries
# ---------------------------------------------------------------------------------------------

def _lora_case(name: str, *, use_rslora: bool = False, init: str = "kaiming", all_linear: bool = False
               ) -> AdapterCase:
    def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
        from rankwise.adapt.lora import LoraConfig, adapt

        target: Any = nn.Linear if (kind == "mlp" or all_linear) else ("query", "value")
        cfg = LoraConfig(rank=4, alpha=8, use_rslora=use_rslora, init=init, seed=seed)
        return adapt(model, cfg, target=target, name=adapter)

    def bad_rank(model: nn.Module, kind: str) -> None:
        from rankwise.adapt.lora import LoraConfig, adapt

        target: Any = nn.Linear if kind == "mlp" else ("query", "value")
        adapt(model, LoraConfig(rank=10_000), target=target)

    def lora_api(fn: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            from rankwise.adapt import lora

            return getattr(lora, fn)(*args)
        return call

    return AdapterCase(
        name=name, apply=apply,
        merge=lora_api("merge"), unmerge=lora_api("unmerge"),
        disable=lora_api("disable_adapters"), enable=lora_api("enable_adapters"),
        set_active=lora_api("set_active"),
        save=lora_api("save_adapter"), load=lora_api("load_adapter"),
        bad_rank=bad_rank,
    )


ADAPTERS: list[AdapterCase] = [
    _lora_case("lora"),
    _lora_case("lora-rslora-gaussian-all-linear", use_rslora=True, init="gaussian", all_linear=True),
    # later adapters append one entry each, e.g.
    # AdapterCase(name="cdka", apply=_cdka_apply, merge=..., unmerge=..., save=..., load=..., bad_rank=...),
]


# ---------------------------------------------------------------------------------------------
# CDKA and PSOFT (rankwise.adapt.cdka / rankwise.adapt.psoft)
# ---------------------------------------------------------------------------------------------

def _calibration(kind: str, seed: int) -> tuple[list[Any], Callable[[nn.Module, Any], torch.Tensor]]:
    """Two seeded calibration batches and a regression loss on the tiny model's outputs (for CDKA's G)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    if kind == "mlp":
        batches = [torch.randn(8, 16, generator=g) for _ in range(2)]
    else:
        batches = [torch.randint(0, 100, (2, 8), generator=g) for _ in range(2)]

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        out = model(batch)
        y = out if isinstance(out, torch.Tensor) else out.last_hidden_state
        target = torch.sin(torch.arange(y.numel(), dtype=y.dtype)).reshape(y.shape)
        return (y - target).square().mean()

    return batches, loss_fn


def _method_api(module: str, fn: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(module), fn)(*args)
    return call


def _cdka_case(name: str, **cfg: Any) -> AdapterCase:
    def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
        from rankwise.adapt.cdka import CDKAConfig, adapt

        target: Any = nn.Linear if kind == "mlp" else ("query", "value")
        config = CDKAConfig(seed=seed, **cfg)
        calib, loss_fn = _calibration(kind, seed)
        return adapt(model, config, target=target, name=adapter, calib=calib, loss_fn=loss_fn)

    def bad_rank(model: nn.Module, kind: str) -> None:
        from rankwise.adapt.cdka import CDKAConfig, adapt

        target: Any = nn.Linear if kind == "mlp" else ("query", "value")
        adapt(model, CDKAConfig(config_mode="fixed", r1=1, r2=1, r=10_000, init="zero"), target=target)

    mod = "rankwise.adapt.cdka"
    return AdapterCase(name=name, apply=apply, merge=_method_api(mod, "merge"), unmerge=_method_api(mod, "unmerge"),
                       disable=_method_api(mod, "disable_adapters"), enable=_method_api(mod, "enable_adapters"),
                       set_active=_method_api(mod, "set_active"), save=_method_api(mod, "save_adapter"),
                       load=_method_api(mod, "load_adapter"), bad_rank=bad_rank)


def _psoft_case(name: str, **cfg: Any) -> AdapterCase:
    def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
        from rankwise.adapt.psoft import PSOFTConfig, adapt

        target: Any = nn.Linear if kind == "mlp" else ("query", "value")
        return adapt(model, PSOFTConfig(r=4, **cfg), target=target, name=adapter)

    def bad_rank(model: nn.Module, kind: str) -> None:
        from rankwise.adapt.psoft import PSOFTConfig, adapt

        target: Any = nn.Linear if kind == "mlp" else ("query", "value")
        adapt(model, PSOFTConfig(r=10_000), target=target)

    mod = "rankwise.adapt.psoft"
    return AdapterCase(name=name, apply=apply, merge=_method_api(mod, "merge"), unmerge=_method_api(mod, "unmerge"),
                       disable=_method_api(mod, "disable_adapters"), enable=_method_api(mod, "enable_adapters"),
                       set_active=_method_api(mod, "set_active"), save=_method_api(mod, "save_adapter"),
                       load=_method_api(mod, "load_adapter"), bad_rank=bad_rank)


ADAPTERS.extend([
    # alpha 4 instead of the paper's 64 keeps the perturbed outputs O(1), where float32 merges are within 1e-5
    _cdka_case("cdka-aligned-gradient", budget="lora_r2", alpha=4.0),
    _cdka_case("cdka-fixed-zero", config_mode="fixed", r1=2, r2=2, r=2, init="zero", alpha=4.0),
    _psoft_case("psoft"),
    _psoft_case("psoft-exact-input-side", cayley="exact", singular_values_on="input"),
])


# ---------------------------------------------------------------------------------------------
# more entries, one file per method: tests/adapt/cases_<method>.py defines ``cases(contract) -> list[AdapterCase]``
# (kept in separate files so that each method's author owns its own entries)
# ---------------------------------------------------------------------------------------------

def _load_case_files() -> None:
    import importlib.util

    for path in sorted(Path(__file__).parent.glob("cases_*.py")):
        spec = importlib.util.spec_from_file_location(f"rankwise_tests_adapt_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ADAPTERS.extend(module.cases(sys.modules[__name__]))


_load_case_files()
