"""The UB-SMoE reproduction's labelling teacher does not depend on the student's router."""

from __future__ import annotations

import torch

from rankwise.federated.ub_smoe import SyntheticMoETask
from rankwise.repro.ub_smoe import DenseTeacherMoETask

KW = dict(num_clients=3, per_client=32, n_test=64, hidden=16, ffn=16, num_experts=8, top_k=4, teacher_rank=2, seed=3)


def test_dense_teacher_labels_ignore_the_router():
    """Only the router's bias differs between the two tasks (router_skew draws nothing): the dense teacher's labels
    are the same, the student-router teacher's are not; the frozen bases keep their own routers."""
    a, b = DenseTeacherMoETask(router_skew=0.0, **KW), DenseTeacherMoETask(router_skew=3.0, **KW)
    assert torch.equal(a.test_data().labels, b.test_data().labels)
    assert torch.equal(a.client_data(1).labels, b.client_data(1).labels)
    assert not torch.equal(a.build_model().moe[0].router.bias, b.build_model().moe[0].router.bias)
    sa, sb = SyntheticMoETask(router_skew=0.0, **KW), SyntheticMoETask(router_skew=3.0, **KW)
    assert not torch.equal(sa.test_data().labels, sb.test_data().labels)


def test_dense_teacher_task_keeps_the_parent_base_and_uses_several_labels():
    t, s = DenseTeacherMoETask(**KW), SyntheticMoETask(**KW)
    for (n, p), (_, q) in zip(t.build_model().state_dict().items(), s.build_model().state_dict().items()):
        assert torch.equal(p, q), n  # the same frozen student; only the labels differ
    assert len(set(t.test_data().labels.tolist())) >= 2
