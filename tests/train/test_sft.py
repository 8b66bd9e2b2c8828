"""The causal-LM SFT loop: prompt masking, hooks, determinism, greedy decoding, bad inputs."""

from __future__ import annotations

import pytest
import torch

from rankwise.core.lmdata import IGNORE_INDEX, collate, encode_pair
from rankwise.train.sft import SFTConfig, SFTTrainer, exact_match, generate, make_sft_batches, sft
from rankwise.zoo.models import tiny_llama
from rankwise.zoo.synthetic import ArithmeticWorld


def _setup(n=24):
    w = ArithmeticWorld(n_digits=2, vocab_size=40)
    tok = w.tokenizer()
    ex = w.examples(w.split(n, 0, seed=0)[0], "add_rev", seed=0)
    return w, tok, ex


def _model(tok):
    return tiny_llama(0, vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)


def test_collate_masks_prompt_and_padding():
    _, tok, ex = _setup(2)
    enc = [encode_pair(tok, e.prompt, e.completion) for e in ex]
    b = collate(enc, tok.pad_token_id)
    for i, (ids, plen) in enumerate(enc):
        assert b.input_ids[i, :len(ids)].tolist() == ids and ids[-1] == tok.eos_token_id
        assert (b.labels[i, :plen] == IGNORE_INDEX).all() and (b.labels[i, len(ids):] == IGNORE_INDEX).all()
        assert b.labels[i, plen:len(ids)].tolist() == ids[plen:]
    nb = collate(enc, tok.pad_token_id, mask_prompt=False)
    assert nb.labels[0, 0] == enc[0][0][0]


def test_sft_is_deterministic_and_learns():
    _, tok, ex = _setup()
    cfg = SFTConfig(steps=8, batch_size=8, lr=1e-2, seed=3)
    runs = []
    for _ in range(2):
        m = _model(tok)
        runs.append(sft(m, tok, ex, cfg).losses)
    assert runs[0] == runs[1]
    assert runs[0][-1] < runs[0][0]


def test_hooks_unit_weights_equal_default():
    from rankwise.train.ranktuner import RankTunerLoss

    _, tok, ex = _setup()
    cfg = SFTConfig(steps=3, batch_size=8)
    ref = sft(_model(tok), tok, ex, cfg).losses
    ones = sft(_model(tok), tok, ex, cfg, weight_fn=lambda lg, lb: torch.ones(lb.shape)).losses
    flat = sft(_model(tok), tok, ex, cfg, loss_fn=RankTunerLoss(gamma=0.0, s_max=None)).losses
    assert ones == pytest.approx(ref, abs=1e-6) and flat == pytest.approx(ref, abs=1e-5)


def test_generate_and_exact_match():
    w, tok, ex = _setup(4)
    outs = generate(_model(tok), tok, [e.prompt for e in ex], max_new_tokens=3, batch_size=3)
    assert len(outs) == 4 and all(isinstance(o, str) for o in outs)
    assert exact_match(["1  2", None, "3"], ["1 2", "1", "4"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        exact_match(["a"], [])


def test_bad_inputs():
    _, tok, ex = _setup(4)
    with pytest.raises(ValueError, match="empty"):
        make_sft_batches(tok, [], SFTConfig(steps=1))
    with pytest.raises(TypeError):
        make_sft_batches(tok, [object()], SFTConfig(steps=1))
    with pytest.raises(ValueError, match="SFTConfig.steps"):
        SFTConfig(steps=0)
    with pytest.raises(ValueError, match="not both"):
        SFTTrainer(_model(tok), SFTConfig(), loss_fn=lambda a, b: a.sum(), weight_fn=lambda a, b: b)
    t = SFTTrainer(_model(tok), SFTConfig(steps=1, batch_size=4), weight_fn=lambda lg, lb: torch.ones(3))
    with pytest.raises(ValueError, match="shaped like the labels"):
        t.step(make_sft_batches(tok, ex, SFTConfig(steps=1, batch_size=4))[0])
    with pytest.raises(ValueError, match="empty completion"):
        encode_pair(tok, "q", "", add_eos=False)
