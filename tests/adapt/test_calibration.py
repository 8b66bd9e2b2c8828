"""The calibration-gradient pass CDKA, E²LoRA and DAF share (rankwise.core.calibration): what it sums,
and that it leaves the model exactly as it found it, also when the loss fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.core.calibration import (
    NonFiniteLoss,
    given_gradients,
    gradient_pass,
    mean_gradients,
)


class Switchable(nn.Linear):
    """A linear layer with an adapter-style ``disabled`` flag (output halved while enabled)."""

    disabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.disabled else 0.5 * y


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Switchable(4, 6), nn.Dropout(0.5), nn.Linear(6, 2))


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)) for _ in range(n)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _state(model: nn.Module) -> tuple:
    return ([p.requires_grad for p in model.parameters()], [None if p.grad is None else p.grad.clone()
                                                           for p in model.parameters()],
            [m.training for m in model.modules()], model[0].disabled)


def _same(a: tuple, b: tuple) -> bool:
    grads_equal = all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                      for x, y in zip(a[1], b[1]))
    return a[0] == b[0] and grads_equal and a[2] == b[2] and a[3] == b[3]


def test_sums_the_gradients_of_the_weights_only_in_float64_and_restores_everything():
    model = _model()
    model[2].weight.grad = torch.ones_like(model[2].weight)  # a caller's .grad on a weight it asks for
    model[0].bias.requires_grad_(False)
    model.train()
    before = _state(model)
    weights = {"0": model[0].weight, "2": model[2].weight}
    sums, n = gradient_pass(model, weights, _batches(), _loss, max_batches=2, disable=[model[0]])
    assert n == 2 and _same(_state(model), before)
    assert all(s.dtype == torch.float64 and s.shape == w.shape for s, w in zip(sums.values(), weights.values()))
    # the reference: eval mode (no dropout), adapter switched off, plain autograd per batch
    ref = _model()
    ref.eval()
    ref[0].disabled = True
    expected = {"0": torch.zeros(6, 4, dtype=torch.float64), "2": torch.zeros(2, 6, dtype=torch.float64)}
    for batch in _batches()[:2]:
        g0, g2 = torch.autograd.grad(_loss(ref, batch), [ref[0].weight, ref[2].weight])
        expected["0"] += g0.double()
        expected["2"] += g2.double()
    assert all(torch.equal(sums[k], expected[k]) for k in sums)
    mean = mean_gradients(sums, n, who="X", zero_hint="")
    assert torch.equal(mean["0"], expected["0"] / 2)


def test_restores_the_model_when_the_loss_fails_midway():
    model = _model()
    before = _state(model)
    calls = []

    def failing(m: nn.Module, batch: tuple) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return _loss(m, batch)

    with pytest.raises(RuntimeError, match="boom"):
        gradient_pass(model, {"0": model[0].weight}, _batches(), failing, disable=[model[0]], train=False)
    assert _same(_state(model), before)
    with pytest.raises(NonFiniteLoss, match="calibration loss is nan on batch 0; G is undefined") as err:
        gradient_pass(model, {"0": model[0].weight}, _batches(), lambda m, b: _loss(m, b) * float("nan"),
                      needs="G is undefined")
    assert err.value.batch == 0 and _same(_state(model), before)
    with pytest.raises(TypeError, match="scalar tensor"):
        gradient_pass(model, {"0": model[0].weight}, _batches(), lambda m, b: m(b[0]))
    with pytest.raises(ValueError, match="does not depend on the targeted weights.*Y needs"):
        gradient_pass(model, {"0": model[0].weight}, _batches(), lambda m, b: _loss(m, b).detach(), who="Y")
    assert _same(_state(model), before)


def test_seeded_train_mode_pass_is_reproducible_and_leaves_the_global_rng():
    model = _model()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    taylor = lambda g, w: (g.double() * w.double()).abs().sum()  # noqa: E731
    a, _ = gradient_pass(model, {"2": model[2].weight}, _batches(), _loss, train=True, seed=3, reduce=taylor)
    b, _ = gradient_pass(model, {"2": model[2].weight}, _batches(), _loss, train=True, seed=3, reduce=taylor)
    c, _ = gradient_pass(model, {"2": model[2].weight}, _batches(), _loss, train=True, seed=4, reduce=taylor)
    assert a["2"].ndim == 0 and torch.equal(a["2"], b["2"]) and not torch.equal(a["2"], c["2"])
    assert torch.equal(torch.get_rng_state(), state)


def test_mean_and_given_gradients_checks():
    with pytest.raises(ValueError, match="yielded no batch; Z needs"):
        mean_gradients({}, 0, who="Z", zero_hint="")
    with pytest.raises(ValueError, match="layer 'a': the calibration gradient is exactly zero \\(why\\)"):
        mean_gradients({"a": torch.zeros(2, 2, dtype=torch.float64)}, 1, who="Z", zero_hint="(why)")
    g = given_gradients({"a": torch.ones(2, 3)}, {"a": (2, 3)})
    assert g["a"].dtype == torch.float64
    with pytest.raises(ValueError, match="lacks layers \\['b'\\]"):
        given_gradients({"a": torch.ones(2, 3)}, {"a": (2, 3), "b": (1, 1)})
    with pytest.raises(ValueError, match="gradients\\['a'\\] must be a tensor of shape \\(3, 2\\)"):
        given_gradients({"a": torch.ones(2, 3)}, {"a": (3, 2)})
    assert given_gradients({"a": torch.zeros(2, 3)}, {"a": (2, 3)})["a"].abs().max() == 0
    with pytest.raises(ValueError, match="exactly zero \\(h\\)"):
        given_gradients({"a": torch.zeros(2, 3)}, {"a": (2, 3)}, check=True, zero_hint="(h)")


def test_the_former_import_path_of_default_loss_still_works():
    from rankwise.core import adapters, calibration

    assert adapters.default_loss is calibration.default_loss
