"""The ARPC codec: fit on images, write real bitstreams, decode progressively (spec §1-6)."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rankwise.core.errors import ArtifactError
from rankwise.core.io import load_tensors, save_tensors, tensor_digest
from rankwise.core.validate import check_choice, check_int, check_number
from rankwise.science.arpc.bitstream import (
    ENTROPY_MODELS,
    BitstreamError,
    Header,
    RangeReader,
    RangeWriter,
    floor_probabilities,
    header_size,
    ideal_bits,
    pack,
    unpack,
)
from rankwise.science.arpc.config import ARPCConfig
from rankwise.science.arpc.images import as_image, from_tiles, to_tiles
from rankwise.science.arpc.model import NextScaleTransformer
from rankwise.science.arpc.quantizer import MultiScaleQuantizer, down

__all__ = ["ARPCCodec", "COMPLETIONS", "DecodeResult", "EncodeResult", "FitResult"]

log = logging.getLogger(__name__)

COMPLETIONS = ("argmax", "sample", "zeros")
CHUNK_TILES = 256  # tiles per AR batch; part of the format (encoder and decoder batch alike)
_KIND = "rankwise-arpc-codec"


@dataclass
class FitResult:
    """What :meth:`ARPCCodec.fit` did: ``steps``, ``seconds``, ``losses`` (training cross-entropy in
    nats per token, one value per logged step), ``train_bits`` (``{"ar": [...], "histogram": [...]}``:
    mean bits per token of each scale on the training tiles under both entropy models) and
    ``quantizer_mse`` (training MSE of ``f_hat_k`` for k = 1..K)."""

    steps: int
    seconds: float
    losses: list[float]
    train_bits: dict[str, list[float]]
    quantizer_mse: list[float]


@dataclass
class EncodeResult:
    """One written bitstream. ``data``: the file's bytes (header included); ``header``; ``ideal_bits``:
    ``sum -log2 p`` of the coded symbols under the floored model (what an ideal coder would spend);
    ``bits_per_scale`` (same, per sent scale); ``tokens``: the sent scales' tokens, ``(n_tiles, C, s_k,
    s_k)`` each; ``tile_grid``: rows and columns of tiles."""

    data: bytes
    header: Header
    ideal_bits: float
    bits_per_scale: list[float]
    tokens: list[Tensor]
    tile_grid: tuple[int, int]

    @property
    def num_bytes(self) -> int:
        return len(self.data)

    @property
    def header_bytes(self) -> int:
        return header_size(self.header)

    @property
    def payload_bytes(self) -> int:
        return len(self.data) - self.header_bytes

    @property
    def bpp(self) -> float:
        """Bits per pixel of the whole file (header included): ``8 * bytes / (H * W)``."""
        return 8.0 * len(self.data) / (self.header.height * self.header.width)

    @property
    def payload_bpp(self) -> float:
        return 8.0 * self.payload_bytes / (self.header.height * self.header.width)


@dataclass
class DecodeResult:
    """A decoded bitstream. ``image``: ``(C, H, W)`` in ``[-1, 1]``; ``header``; ``tokens``: one entry
    per scale (``None`` for a zero-filled scale); ``num_scales_sent``; ``complete``: how the unsent
    scales were filled."""

    image: Tensor
    header: Header
    tokens: list[Tensor | None]
    num_scales_sent: int
    complete: str
    extra: dict[str, Any] = field(default_factory=dict)


def _seq(x: Tensor) -> Tensor:
    """``(N, C, s, s) -> (N, s*s, C)``: a scale's grid as sequence positions (raster order)."""
    n, c = x.shape[:2]
    return x.reshape(n, c, -1).transpose(1, 2)


def _grid(seq: Tensor, s: int) -> Tensor:
    """Inverse of :func:`_seq`."""
    n, _, c = seq.shape
    return seq.transpose(1, 2).reshape(n, c, s, s)


class ARPCCodec:
    """Multi-scale residual quantizer + next-scale AR transformer + constriction range coder.

    ``fit(images)`` learns the quantizer, the AR model and the static per-scale histograms (the
    baseline entropy model). ``encode(img, num_scales)`` writes a bitstream of the first
    ``num_scales`` scales (:class:`EncodeResult`; ``compress`` returns only its bytes);
    ``decode(data, complete)`` reads it and fills the unsent scales by AR arg-max, AR sampling or
    zeros (:class:`DecodeResult`; ``decompress`` returns only the image). ``save``/``load``: one
    safetensors file. All coding runs on CPU in float64, so the encoder and decoder compute the same
    probabilities on the same machine.
    """

    def __init__(self, config: ARPCConfig | None = None) -> None:
        if config is None:
            config = ARPCConfig()
        if not isinstance(config, ARPCConfig):
            raise TypeError(f"config must be an ARPCConfig, got {type(config).__name__}")
        self.config = config
        self.quantizer = MultiScaleQuantizer(config)
        self.ar = NextScaleTransformer(config)
        self.histograms = torch.full((config.num_scales, config.max_vocab), 1.0, dtype=torch.float64)
        self.fit_result: FitResult | None = None
        self._hash: bytes | None = None
        self._coder: NextScaleTransformer | None = None

    # ---- identity ------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Tensor]:
        out = {f"quantizer.{k}": v for k, v in self.quantizer.state_dict().items()}
        out.update({f"ar.{k}": v for k, v in self.ar.state_dict().items()})
        out["histograms"] = self.histograms
        return out

    @property
    def model_hash(self) -> bytes:
        """4 bytes of SHA-256 over the config and every weight (what headers carry)."""
        if self._hash is None:
            h = hashlib.sha256(self.config.digest().encode())
            for name, t in sorted(self._state().items()):
                h.update(f"{name}:{tensor_digest(t)}".encode())
            self._hash = h.digest()[:4]
        return self._hash

    def _changed(self) -> None:
        self._hash = None
        self._coder = None

    @property
    def fitted(self) -> bool:
        return bool(self.quantizer.fitted)

    def _check_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError("the codec is not fitted: call fit(images) or ARPCCodec.load(path) first")

    # ---- training -----------------------------------------------------------------------------------
    def _training_tiles(self, images: Any) -> Tensor:
        c = self.config
        if isinstance(images, Tensor) and images.dim() == 4:
            if images.shape[2] % c.tile or images.shape[3] % c.tile:
                raise ValueError(f"training images of size {images.shape[2]}x{images.shape[3]} are not multiples "
                                 f"of the tile side {c.tile}")
            ims: Iterable[Any] = images
        elif isinstance(images, (list, tuple)) and images:
            ims = images
        else:
            raise ValueError("images must be a tensor (N, C, H, W) or a non-empty list of (C, H, W) images")
        tiles = [to_tiles(as_image(im, c.channels), c.tile)[0] for im in ims]
        return torch.cat(tiles)

    def _sequences(self, tiles: Tensor) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
        """Teacher-forcing inputs ``(N, L, C)`` and targets ``(N, L, C)`` of tiles, with tokens and f_hats."""
        c = self.config
        tokens, f_hats = self.quantizer.encode(tiles)
        prev = [torch.zeros_like(tiles)] + f_hats[:-1]
        inputs = torch.cat([_seq(down(p, s)) for p, s in zip(prev, c.scales)], dim=1)
        targets = torch.cat([_seq(t) for t in tokens], dim=1)
        return inputs, targets, tokens, f_hats

    def fit(self, images: Any, *, steps: int = 2000, batch_size: int = 64, lr: float = 3e-3,
            warmup: float = 0.05, seed: int = 0, log_every: int = 50, max_seconds: float | None = None,
            progress: bool = False) -> FitResult:
        """Fit quantizer, histograms and AR model on ``images`` (a tensor ``(N, C, H, W)`` or a list of
        ``(C, H, W)``, values in ``[-1, 1]``, sides multiples of the tile, or padded when in a list).

        The AR model is trained with teacher forcing (cross-entropy of ``t_k`` given ``t_{<k}``) by Adam
        at ``lr`` (linear warm-up over ``warmup`` of the steps, cosine decay to 10 %), batches of
        ``batch_size`` tiles drawn with a generator seeded by ``seed``; parameters are initialised
        under ``seed``. ``max_seconds`` stops early (the steps done are reported).
        """
        check_int("steps", steps, 1)
        check_int("batch_size", batch_size, 1)
        check_number("lr", lr, 0.0, 1.0, low_open=True)
        check_number("warmup", warmup, 0.0, 1.0)
        check_int("seed", seed, 0)
        t0 = time.perf_counter()
        c = self.config
        tiles = self._training_tiles(images)
        self.quantizer.fit(tiles)
        inputs, targets, tokens, f_hats = self._sequences(tiles)
        hist = torch.zeros(c.num_scales, c.max_vocab, dtype=torch.float64)
        for k, t in enumerate(tokens):
            hist[k, : c.vocab(k)] = torch.bincount(t.reshape(-1), minlength=c.vocab(k)).double() + 1.0
        self.histograms = hist
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.ar = NextScaleTransformer(c)
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(self.ar.parameters(), lr=lr)
        n_warm = max(1, int(warmup * steps))

        def rate(i: int) -> float:
            if i < n_warm:
                return (i + 1) / n_warm
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - n_warm) / max(1, steps - n_warm)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
        losses: list[float] = []
        self.ar.train()
        done = 0
        for i in range(steps):
            idx = torch.randint(len(tiles), (min(batch_size, len(tiles)),), generator=gen)
            logits = self.ar(inputs[idx])
            loss = F.cross_entropy(logits.reshape(-1, c.max_vocab), targets[idx].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            done = i + 1
            if i % log_every == 0 or i == steps - 1:
                losses.append(float(loss.detach()))
                if progress:
                    log.info("arpc fit step %d/%d loss %.4f", i + 1, steps, losses[-1])
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
        self.ar.eval()
        self._changed()
        bits = self._train_bits(inputs, targets)
        mse = [float(((fh - tiles) ** 2).mean()) for fh in f_hats]
        self.fit_result = FitResult(done, time.perf_counter() - t0, losses, bits, mse)
        return self.fit_result

    @torch.no_grad()
    def _train_bits(self, inputs: Tensor, targets: Tensor) -> dict[str, list[float]]:
        c = self.config
        sums = torch.zeros(c.num_scales, dtype=torch.float64)
        for i in range(0, len(inputs), 512):
            lp = torch.log_softmax(self.ar(inputs[i:i + 512]).double(), -1)
            nll = -lp.gather(-1, targets[i:i + 512, ..., None]).squeeze(-1)  # (n, L, C)
            sums += torch.stack([nll[:, self._span(k)].sum() for k in range(c.num_scales)])
        n_tok = torch.tensor([len(inputs) * s * s * c.channels for s in c.scales], dtype=torch.float64)
        ar = (sums / n_tok / math.log(2)).tolist()
        hp = self.histograms / self.histograms.sum(1, keepdim=True)
        hist = []
        for k in range(c.num_scales):
            t = targets[:, self._span(k)].reshape(-1)
            hist.append(float(-torch.log2(hp[k, t]).mean()))
        return {"ar": ar, "histogram": hist}

    def _span(self, k: int) -> slice:
        a = self.ar.prefix_length(k)
        return slice(a, a + self.config.scales[k] ** 2)

    # ---- probabilities --------------------------------------------------------------------------------
    def _coder_model(self) -> NextScaleTransformer:
        if self._coder is None:
            import copy

            self._coder = copy.deepcopy(self.ar).to(torch.float64).eval()
        return self._coder

    @torch.no_grad()
    def _probs(self, entropy_model: str, inputs: list[Tensor], k: int, n: int) -> Tensor:
        """``(n, s_k^2, C, V_k)`` float64 probabilities of scale ``k`` given the prefix inputs."""
        c = self.config
        V = c.vocab(k)
        s = c.scales[k]
        if entropy_model == "histogram":
            p = self.histograms[k, :V] / self.histograms[k, :V].sum()
            return p.expand(n, s * s, c.channels, V)
        logits = self._coder_model()(torch.cat(inputs, dim=1))[:, self._span(k), :, :V]
        return torch.softmax(logits, dim=-1)

    def _floored(self, p: Tensor) -> np.ndarray:
        return floor_probabilities(p.reshape(-1, p.shape[-1]).numpy(), self.config.prob_floor)

    # ---- encoding ---------------------------------------------------------------------------------------
    def encode(self, img: Any, num_scales: int | None = None, *, entropy_model: str = "ar",
               pad: bool = True) -> EncodeResult:
        """Write the first ``num_scales`` scales (default: all) of ``img (C, H, W)`` in ``[-1, 1]``.

        ``entropy_model``: ``"ar"`` (the next-scale transformer's ``p(t_k | t_<k)``) or
        ``"histogram"`` (the static per-scale token histograms of the training set, the baseline).
        ``pad=False`` refuses sizes that are not multiples of the tile side instead of padding.
        """
        self._check_fitted()
        c = self.config
        k_sent = c.num_scales if num_scales is None else num_scales
        check_int("num_scales", k_sent, 1, c.num_scales)
        check_choice("entropy_model", entropy_model, ENTROPY_MODELS)
        x = as_image(img, c.channels)
        H, W = x.shape[1:]
        tiles, grid = to_tiles(x, c.tile, pad=pad)
        writer = RangeWriter()
        bits = [0.0] * k_sent
        sent: list[list[Tensor]] = [[] for _ in range(k_sent)]
        for a in range(0, len(tiles), CHUNK_TILES):
            chunk = tiles[a:a + CHUNK_TILES]
            tokens, _ = self.quantizer.encode(chunk)
            f_hat = torch.zeros(chunk.shape, dtype=torch.float64)
            inputs: list[Tensor] = []
            for k in range(k_sent):
                inputs.append(_seq(down(f_hat, c.scales[k])))
                p = self._floored(self._probs(entropy_model, inputs, k, len(chunk)))
                sym = _seq(tokens[k]).reshape(-1).numpy()
                writer.encode(sym, p)
                bits[k] += float(ideal_bits(sym, p).sum())
                f_hat = self.quantizer.add_scale(f_hat, tokens[k], k)
                sent[k].append(tokens[k])
        header = Header(num_scales=k_sent, channels=c.channels, entropy_model=entropy_model,
                        model_hash=self.model_hash, height=int(H), width=int(W))
        data = pack(header, writer.payload())
        return EncodeResult(data, header, float(sum(bits)), bits, [torch.cat(t) for t in sent], grid)

    def compress(self, img: Any, num_scales: int | None = None, **kwargs: Any) -> bytes:
        """The bytes of :meth:`encode` (the file to write)."""
        return self.encode(img, num_scales, **kwargs).data

    # ---- decoding ---------------------------------------------------------------------------------------
    def read_header(self, data: bytes) -> Header:
        """Parse and check a bitstream's header against this codec (:class:`BitstreamError` if it does
        not fit: another model, channel count or too many scales)."""
        header, _ = unpack(data)
        self._check_header(header)
        return header

    def _check_header(self, header: Header) -> None:
        c = self.config
        if header.model_hash != self.model_hash:
            raise BitstreamError(f"the bitstream was written by another model (hash {header.model_hash.hex()}, "
                                 f"this codec is {self.model_hash.hex()})")
        if header.channels != c.channels:
            raise BitstreamError(f"the bitstream has {header.channels} channels, this codec codes {c.channels}")
        if header.num_scales > c.num_scales:
            raise BitstreamError(f"the bitstream sends {header.num_scales} scales, this codec has {c.num_scales}")

    def decode(self, data: bytes, complete: str = "argmax", *, seed: int = 0) -> DecodeResult:
        """Read a bitstream and reconstruct the image (spec §5).

        The sent scales are decoded exactly; the others are filled by ``complete``: ``"argmax"`` (the
        AR model's most likely token at every position), ``"sample"`` (drawn from the AR model with a
        generator seeded by ``seed``) or ``"zeros"`` (no correction: ``f_hat`` stops at the last sent
        scale).
        """
        self._check_fitted()
        check_choice("complete", complete, COMPLETIONS)
        check_int("seed", seed, 0)
        header, payload = unpack(data)
        self._check_header(header)
        c = self.config
        k_sent, T = header.num_scales, c.tile
        rows, cols = -(-header.height // T), -(-header.width // T)
        n_tiles = rows * cols
        reader = RangeReader(payload)
        gen = torch.Generator().manual_seed(seed)
        last = k_sent if complete == "zeros" else c.num_scales
        tok_out: list[list[Tensor]] = [[] for _ in range(last)]
        recon = []
        for a in range(0, n_tiles, CHUNK_TILES):
            n = min(CHUNK_TILES, n_tiles - a)
            f_hat = torch.zeros(n, c.channels, T, T, dtype=torch.float64)
            inputs: list[Tensor] = []
            for k in range(last):
                s = c.scales[k]
                inputs.append(_seq(down(f_hat, s)))
                if k < k_sent:
                    p = self._probs(header.entropy_model, inputs, k, n)
                    sym = reader.decode(self._floored(p))
                    t = _grid(torch.from_numpy(sym).view(n, s * s, c.channels), s)
                else:
                    p = self._probs("ar", inputs, k, n)
                    if complete == "argmax":
                        t = _grid(p.argmax(-1), s)
                    else:
                        flat = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=gen)
                        t = _grid(flat.view(n, s * s, c.channels), s)
                f_hat = self.quantizer.add_scale(f_hat, t, k)
                tok_out[k].append(t)
            recon.append(f_hat.clamp(-1, 1).to(torch.float32))
        img = from_tiles(torch.cat(recon), (rows, cols), header.height, header.width)
        tokens: list[Tensor | None] = [torch.cat(t) for t in tok_out] + [None] * (c.num_scales - last)
        return DecodeResult(img, header, tokens, k_sent, complete)

    def decompress(self, data: bytes, complete: str = "argmax", **kwargs: Any) -> Tensor:
        """The image of :meth:`decode`."""
        return self.decode(data, complete, **kwargs).image

    # ---- persistence ------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """One safetensors file (atomic): quantizer, AR weights, histograms; the config in the metadata."""
        self._check_fitted()
        meta: dict[str, Any] = {"kind": _KIND, "config": self.config.to_dict(), "model_hash": self.model_hash.hex()}
        if self.fit_result is not None:
            fr = self.fit_result
            meta["fit"] = {"steps": fr.steps, "seconds": fr.seconds, "losses": fr.losses,
                           "train_bits": fr.train_bits, "quantizer_mse": fr.quantizer_mse}
        return save_tensors(path, self._state(), meta)

    @classmethod
    def load(cls, path: str | Path) -> "ARPCCodec":
        """Load a codec written by :meth:`save`; :class:`ArtifactError` (one line) if the file is not one."""
        tensors, meta = load_tensors(path)
        if meta.get("kind") != _KIND:
            raise ArtifactError(f"{path}: not an ARPC codec file (kind {meta.get('kind')!r})")
        try:
            config = ARPCConfig.from_dict(meta["config"])
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{path}: invalid ARPC config ({e})") from None
        codec = cls(config)
        try:
            codec.quantizer.load_state_dict({k[10:]: v for k, v in tensors.items() if k.startswith("quantizer.")})
            codec.ar.load_state_dict({k[3:]: v for k, v in tensors.items() if k.startswith("ar.")})
            codec.histograms = tensors["histograms"].to(torch.float64)
        except (KeyError, RuntimeError) as e:
            raise ArtifactError(f"{path}: the tensors do not fit the ARPC config ({str(e).splitlines()[0]})") from None
        if tuple(codec.histograms.shape) != (config.num_scales, config.max_vocab):
            raise ArtifactError(f"{path}: histograms of shape {tuple(codec.histograms.shape)} do not fit the config")
        codec.ar.eval()
        codec._changed()
        if "model_hash" in meta and meta["model_hash"] != codec.model_hash.hex():
            raise ArtifactError(f"{path}: the model hash does not match its weights (the file was altered)")
        if "fit" in meta:
            f = meta["fit"]
            codec.fit_result = FitResult(f["steps"], f["seconds"], f["losses"], f["train_bits"], f["quantizer_mse"])
        return codec

    # ---- evaluation helpers -----------------------------------------------------------------------------
    def token_bits(self, img: Any, entropy_model: str = "ar") -> list[float]:
        """Ideal bits of each scale's tokens of ``img`` (all K scales, no file written)."""
        return self.encode(img, None, entropy_model=entropy_model).bits_per_scale


def rate_distortion(codec: ARPCCodec, images: Sequence[Any], num_scales: Sequence[int] | None = None,
                    completes: Sequence[str] = ("argmax", "zeros"),
                    entropy_models: Sequence[str] = ("ar", "histogram")) -> dict[str, Any]:
    """Per-image rates and distortions of ``codec`` on ``images`` (what the reproduction measures).

    Returns ``{"num_scales": [...], "bytes": {model: (n_img, n_k)}, "ideal_bits": {model: ...},
    "bits_per_scale": {model: (n_img, n_k, k)...}, "mse": {complete: (n_img, n_k)},
    "exact": (n_img, n_k) bool}`` as numpy arrays; ``exact`` is True where every sent token decoded
    equal to the encoded one. MSE is in the ``[-1, 1]`` pixel scale and uses the bitstream of the
    first entropy model.
    """
    ks = list(num_scales or range(1, codec.config.num_scales + 1))
    n, m = len(images), len(ks)
    out: dict[str, Any] = {"num_scales": ks, "bytes": {}, "ideal_bits": {}, "mse": {}, "exact": np.zeros((n, m), bool),
                           "pixels": np.zeros(n)}
    for em in entropy_models:
        out["bytes"][em] = np.zeros((n, m))
        out["ideal_bits"][em] = np.zeros((n, m))
    for cm in completes:
        out["mse"][cm] = np.zeros((n, m))
    for i, img in enumerate(images):
        x = as_image(img, codec.config.channels)
        out["pixels"][i] = x.shape[1] * x.shape[2]
        for j, k in enumerate(ks):
            for e_i, em in enumerate(entropy_models):
                r = codec.encode(x, k, entropy_model=em)
                out["bytes"][em][i, j] = r.num_bytes
                out["ideal_bits"][em][i, j] = r.ideal_bits
                if e_i:
                    continue
                for cm in completes:
                    d = codec.decode(r.data, cm)
                    out["mse"][cm][i, j] = float(((d.image - x) ** 2).mean())
                    if cm == completes[0]:
                        out["exact"][i, j] = all(torch.equal(a, b) for a, b in zip(r.tokens, d.tokens[:k]))
    return out
