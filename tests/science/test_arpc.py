"""ARPC (science/arpc): the spec's correctness checks and bad inputs.

Codecs here are tiny (width 16, a few training steps): the tests check exactness and the format, not
the compression quality (the reproduction does that).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rankwise.core.errors import ArtifactError
from rankwise.science import arpc
from rankwise.science.arpc import ARPCCodec, ARPCConfig, BitstreamError

TINY = dict(ar_width=16, ar_heads=2, ar_layers=1)


def _digits(n: int = 96, seed: int = 0) -> torch.Tensor:
    from sklearn.datasets import load_digits

    x = torch.from_numpy(load_digits().images[:n].astype(np.float32) / 16.0).unsqueeze(1)
    x = torch.nn.functional.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False).clamp(0, 1)
    return x * 2 - 1


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return _digits()


@pytest.fixture(scope="module")
def codec(data: torch.Tensor) -> ARPCCodec:
    c = ARPCCodec(ARPCConfig(**TINY))
    c.fit(data[:80], steps=6, batch_size=8, seed=0)
    return c


@pytest.fixture
def coder() -> None:
    pytest.importorskip("constriction")


# ---- the range coder ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_range_coder_round_trip_and_length(coder: None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, V = 4000, int(rng.integers(2, 40))
    p = arpc.floor_probabilities(rng.dirichlet(np.full(V, 0.5), size=n), 2.0 ** -16)
    sym = np.array([rng.choice(V, p=row) for row in p])
    w = arpc.RangeWriter()
    w.encode(sym, p)
    data = w.payload()
    assert np.array_equal(arpc.RangeReader(data).decode(p), sym)
    ideal = arpc.ideal_bits(sym, p).sum()
    assert 8 * len(data) <= 1.01 * ideal + 32


def test_probability_floor(coder: None) -> None:
    p = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    f = arpc.floor_probabilities(p, 1e-4)
    assert (f > 0).all() and np.allclose(f.sum(1), 1.0)
    w = arpc.RangeWriter()
    with pytest.raises(ValueError, match="probability 0"):
        w.encode(np.array([1, 0]), p)  # an occurring symbol with p = 0 fails loudly
    with pytest.raises(ValueError, match="NaN"):
        arpc.floor_probabilities(np.array([[np.nan, 1.0]]), 1e-4)


# ---- quantizer and model --------------------------------------------------------------------------

@pytest.mark.parametrize("quantizer", ["vq", "bitplane"])
def test_residual_mse_non_increasing(data: torch.Tensor, quantizer: str) -> None:
    q = arpc.MultiScaleQuantizer(ARPCConfig(quantizer=quantizer, **TINY)).fit(data)
    _, f_hats = q.encode(data)
    mse = [float(((f - data) ** 2).mean()) for f in f_hats]
    assert all(b <= a + 1e-7 for a, b in zip(mse, mse[1:])), mse
    assert mse[-1] < (0.01 if quantizer == "vq" else 0.05)  # bitplane keeps 1 plane at the finest scale


def test_kmeans_codebook_sorted() -> None:
    cb = arpc.kmeans_1d(torch.tensor([0.0] * 50 + [1.0] * 50), 4)
    assert cb.shape == (4,) and bool((cb[1:] > cb[:-1]).all())


def test_ar_model_is_block_causal() -> None:
    cfg = ARPCConfig(**TINY)
    torch.manual_seed(0)
    m = arpc.NextScaleTransformer(cfg).eval()
    x = torch.randn(2, cfg.positions, 1)
    base = m(x)
    for k in range(1, cfg.num_scales):  # changing what scales > k see leaves the logits of scales <= k alone
        n = m.prefix_length(k)
        y = x.clone()
        y[:, n:] += torch.randn_like(y[:, n:])
        out = m(y)
        assert torch.equal(out[:, :n], base[:, :n])
        assert not torch.equal(out[:, n:], base[:, n:])


def test_probabilities_deterministic(codec: ARPCCodec, data: torch.Tensor) -> None:
    inputs = [torch.randn(3, 1, 1, dtype=torch.float64), torch.randn(3, 4, 1, dtype=torch.float64)]
    a = codec._probs("ar", inputs, 1, 3)
    codec._coder = None  # a fresh float64 copy
    b = codec._probs("ar", inputs, 1, 3)
    assert torch.equal(a, b)


# ---- the codec -------------------------------------------------------------------------------------

def test_all_scales_round_trip_equals_quantizer(coder: None, codec: ARPCCodec, data: torch.Tensor) -> None:
    for x in data[80:84]:
        r = codec.encode(x)
        d = codec.decode(r.data)
        assert all(torch.equal(a, b) for a, b in zip(r.tokens, d.tokens))
        ref = codec.quantizer.reconstruct(r.tokens).clamp(-1, 1)[0]
        assert torch.allclose(d.image, ref.to(d.image.dtype), atol=1e-6)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("entropy", ["ar", "histogram"])
def test_progressive_round_trip(coder: None, codec: ARPCCodec, data: torch.Tensor, k: int, entropy: str) -> None:
    x = data[85]
    r = codec.encode(x, k, entropy_model=entropy)
    assert r.header.num_scales == k and r.header.entropy_model == entropy
    z = codec.decode(r.data, "zeros")
    assert all(torch.equal(a, b) for a, b in zip(r.tokens, z.tokens[:k])) and z.tokens[k] is None
    assert torch.allclose(z.image, codec.quantizer.reconstruct(r.tokens).clamp(-1, 1)[0].float(), atol=1e-6)
    a = codec.decode(r.data, "argmax")
    assert all(t is not None for t in a.tokens)
    s1, s2 = codec.decode(r.data, "sample", seed=3), codec.decode(r.data, "sample", seed=3)
    assert torch.equal(s1.image, s2.image)


def test_bpp_counts_header(coder: None, codec: ARPCCodec, data: torch.Tensor) -> None:
    r = codec.encode(data[86], 2)
    assert r.header_bytes == 14 and len(r.data) == r.header_bytes + r.payload_bytes
    assert r.bpp == pytest.approx(8 * len(r.data) / 256)
    assert codec.encode(data[86], 2).data == r.data  # deterministic


def test_padding_and_multiple_chunks(coder: None, codec: ARPCCodec, data: torch.Tensor,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import rankwise.science.arpc.codec as mod

    monkeypatch.setattr(mod, "CHUNK_TILES", 2)
    img = torch.cat([data[87, :, :, :], data[88, :, :, :5]], dim=2)[:, :13]  # 13 x 21: pads to 2 x 2 tiles
    r = codec.encode(img)
    d = codec.decode(r.data)
    assert d.image.shape == (1, 13, 21)
    assert all(torch.equal(a, b) for a, b in zip(r.tokens, d.tokens))
    with pytest.raises(ValueError, match="not a multiple of the tile"):
        codec.encode(img, pad=False)


def test_bitplane_and_rgb_codecs(coder: None, data: torch.Tensor) -> None:
    cfg = ARPCConfig(quantizer="bitplane", bits=4, **TINY)
    assert cfg.group_schedule == (4, 3, 2, 2, 1) and cfg.vocab(4) == 2
    c = ARPCCodec(cfg)
    c.fit(data[:40], steps=2, batch_size=8)
    r = c.encode(data[90], 4)
    assert all(torch.equal(a, b) for a, b in zip(r.tokens, c.decode(r.data).tokens))
    rgb = ARPCCodec(ARPCConfig(channels=3, scales=(1, 2, 4, 8), **TINY))
    imgs = torch.rand(6, 3, 8, 8) * 2 - 1
    rgb.fit(imgs, steps=2, batch_size=4)
    r = rgb.encode(imgs[0])
    assert all(torch.equal(a, b) for a, b in zip(r.tokens, rgb.decode(r.data).tokens))


def test_save_load_keeps_the_hash(coder: None, codec: ARPCCodec, data: torch.Tensor, tmp_path) -> None:
    blob = codec.compress(data[91], 3)
    path = codec.save(tmp_path / "c.safetensors")
    loaded = ARPCCodec.load(path)
    assert loaded.model_hash == codec.model_hash
    assert torch.equal(loaded.decompress(blob), codec.decompress(blob))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ArtifactError):
        ARPCCodec.load(tmp_path / "bad.safetensors")


# ---- bad input -------------------------------------------------------------------------------------

def test_truncated_and_corrupted_bitstreams(coder: None, codec: ARPCCodec, data: torch.Tensor) -> None:
    blob = codec.compress(data[92], 4)
    for bad in (blob[:-1], blob[:10], blob[:3]):
        with pytest.raises(BitstreamError, match="truncated"):
            codec.decode(bad)
    flipped = bytearray(blob)
    flipped[-2] ^= 0x10
    with pytest.raises(BitstreamError, match="corrupted"):
        codec.decode(bytes(flipped))
    with pytest.raises(BitstreamError, match="not an ARPC"):
        codec.decode(b"PNG...." + blob)
    version = bytearray(blob)
    version[2] = (7 << 4) | 4
    with pytest.raises(BitstreamError, match="version 7"):
        codec.decode(bytes(version))


def test_another_models_bitstream_is_refused(coder: None, codec: ARPCCodec, data: torch.Tensor) -> None:
    other = ARPCCodec(ARPCConfig(**TINY))
    other.fit(data[:80], steps=6, batch_size=8, seed=1)
    blob = other.compress(data[93], 2)
    with pytest.raises(BitstreamError, match="another model"):
        codec.decode(blob)


def test_bad_config_and_inputs(codec: ARPCCodec, data: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="groups must hold one entry per scale"):
        ARPCConfig(quantizer="bitplane", groups=(4, 3))  # mask shape mismatch
    with pytest.raises(ValueError, match="groups"):
        ARPCConfig(quantizer="bitplane", bits=4, groups=(5, 4, 3, 2, 1))
    with pytest.raises(ValueError, match="strictly increasing"):
        ARPCConfig(scales=(1, 4, 2))
    with pytest.raises(ValueError, match="num_scales"):
        codec.encode(data[0], 0)
    with pytest.raises(ValueError, match="num_scales"):
        codec.encode(data[0], 6)
    nan = data[0].clone()
    nan[0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(nan)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        codec.encode(data[0] * 3)
    with pytest.raises(ValueError, match="1-channel"):
        codec.encode(torch.zeros(3, 16, 16))
    with pytest.raises(ValueError, match="tiles must have shape"):
        codec.quantizer.encode(torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match="complete"):
        codec.decode(b"AR", "mean")
    with pytest.raises(RuntimeError, match="not fitted"):
        ARPCCodec(ARPCConfig(**TINY)).encode(data[0])
