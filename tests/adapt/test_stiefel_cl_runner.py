"""The continual loop of rankwise.adapt.stiefel_cl: metrics, and the baselines' constraints on a tiny encoder."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rankwise.adapt.stiefel_cl.baselines import InfLoRALike, OLoRA, make_learner
from rankwise.adapt.stiefel_cl.runner import ContinualTask, MultiHeadModel, continual_metrics, run_continual


def test_metrics_of_a_known_matrix():
    R = [[0.8, None, None], [0.6, 0.9, None], [0.5, 0.7, 1.0]]
    m = continual_metrics(R, before=[0.5, 0.6, 0.7], zero_shot=[0.5, 0.5, 0.5])
    assert m["MFN"] == pytest.approx((0.5 + 0.7 + 1.0) / 3)
    assert m["MAA"] == pytest.approx((0.8 + (0.6 + 0.9) / 2 + (0.5 + 0.7 + 1.0) / 3) / 3)
    assert m["BWT"] == pytest.approx(((0.5 - 0.8) + (0.7 - 0.9)) / 2)
    assert m["FWT"] == pytest.approx(((0.6 - 0.5) + (0.7 - 0.5)) / 2)
    assert math.isnan(continual_metrics([[0.7]])["BWT"])
    with pytest.raises(ValueError, match="lower-triangular"):
        continual_metrics([[0.5, None], [None, 0.5]])


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 24), nn.Linear(24, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _tasks() -> list[ContinualTask]:
    out = []
    for t in range(3):
        g = torch.Generator().manual_seed(t)
        X = torch.randn(64, 12, generator=g)
        y = (X[:, t] > 0).long()
        batches = [({"x": X[i:i + 16]}, y[i:i + 16]) for i in range(0, 64, 16)]
        out.append(ContinualTask(f"t{t}", 2, batches[:3], batches[3:], batches[:2]))
    return out


def _loss(model, batch):
    return nn.functional.cross_entropy(model(**batch[0]), batch[1])


@pytest.mark.parametrize("method", ["eblora", "lora", "olora", "inflora"])
def test_every_learner_runs_the_loop(method):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    model = MultiHeadModel(_Encoder(), 16)
    learner = make_learner(method, model, ("fc1", "fc2"), 2, 4.0, _loss, energy_threshold=0.9, seed=0)
    res = run_continual(learner, model, _tasks(), epochs=2, lr=1e-2, head_lr=1e-2, probe_steps=5)
    assert len(res.R) == 3 and all(res.R[i][j] is not None for i in range(3) for j in range(i + 1))
    assert set(res.metrics()) == {"MFN", "MAA", "BWT", "FWT"}
    assert len(res.spectra) == 3 and all(set(s) == {"encoder.fc1", "encoder.fc2"} for s in res.spectra)
    if method == "eblora":
        assert max(v for s in res.spectra for v in s.values()) < 1 + 1e-4
    assert not any(p.requires_grad for p in model.heads.parameters())  # heads frozen after their task


def test_olora_penalises_overlap_with_earlier_tasks():
    pytest.importorskip("peft")
    torch.manual_seed(0)
    model = MultiHeadModel(_Encoder(), 16)
    learner = OLoRA(model, ("fc1",), 2, 4.0, _loss, lam=0.5)
    tasks = _tasks()
    run_continual(learner, model, tasks, epochs=1, probe_steps=2, stop=1)
    assert len(learner.previous["encoder.fc1"]) == 1
    model.add_head("t1", 2, 0)
    model.active = "t1"
    learner.begin_task(tasks[1].grad, "t1")
    pen = learner.penalty().detach()
    (A, olds), = learner._pairs
    assert float(pen) == pytest.approx(0.5 * float((A.detach() @ olds[0].T).square().sum()), rel=1e-6) and float(pen) > 0


def test_inflora_keeps_A_out_of_the_protected_subspace():
    pytest.importorskip("peft")
    torch.manual_seed(0)
    model = MultiHeadModel(_Encoder(), 16)
    learner = InfLoRALike(model, ("fc1",), 2, 4.0, _loss, energy_threshold=0.9)
    run_continual(learner, model, _tasks(), epochs=1, lr=1e-2, probe_steps=2, stop=2)
    F = learner.bases["encoder.fc1"]
    assert 0 < F.shape[1] < 12
    # task 2 ran with A projected after every step: the last A seen is orthogonal to the basis it was given
    (A, F_used), = learner._pairs
    assert float((A.detach() @ F_used).abs().max()) < 1e-5
