"""The ARPC file format and the entropy coder (constriction's range coder, spec §4).

A file is a header followed by the range coder's payload::

    offset  size  field
    0       2     magic b"AR"
    2       1     format version (high 4 bits, = 1) | scales sent k (low 4 bits, 1..15)
    3       1     channels - 1 (bits 0-1) | entropy model (bit 2: 0 = AR, 1 = static histogram); bits 3-7 zero
    4       4     model hash: the first 4 bytes of SHA-256 over the codec's config and weights
    8       1-3   image height, unsigned LEB128 varint
    .       1-3   image width, unsigned LEB128 varint
    .       4     CRC-32 (big endian) of the header bytes before it and the payload
    .       rest  payload: constriction's 32-bit words, big endian, trailing zero bytes dropped

A 16 x 16 image has a 14-byte header; bpp counts it (8 * file bytes / (H * W)). Dropping the trailing
zero bytes of the last words is exact: the reader pads the payload with zero bytes back to whole words.

Entropy coding uses ``constriction.stream.queue.RangeEncoder`` / ``RangeDecoder`` with the model family
``constriction.stream.model.Categorical(perfect=False)`` and one probability row per symbol. Before
coding, every row is mixed with the uniform distribution so that each symbol of the alphabet has at
least ``prob_floor`` (:func:`floor_probabilities`); an occurring symbol can therefore never have
probability 0. constriction is imported inside the functions (an optional dependency).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from rankwise.core.errors import ArtifactError, RankwiseError

__all__ = ["BitstreamError", "Header", "RangeReader", "RangeWriter", "floor_probabilities", "ideal_bits",
           "pack", "unpack", "MAGIC", "VERSION"]

MAGIC = b"AR"
VERSION = 1
ENTROPY_MODELS = ("ar", "histogram")
_MAX_SIDE = 1 << 20


class BitstreamError(ArtifactError):
    """An ARPC bitstream is truncated, corrupted, of another version, or written by another model."""


def _constriction():
    try:
        import constriction
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise RankwiseError("ARPC's entropy coder needs the constriction package "
                            "(pip install 'rankwise[codec]' or pip install constriction)") from e
    return constriction


def floor_probabilities(p: np.ndarray, floor: float) -> np.ndarray:
    """Rows of ``p (n, V)`` mixed with the uniform distribution: ``(1 - V floor) p + floor`` (float64).

    Raises ``ValueError`` for non-finite or negative entries or rows that do not sum to 1 (±1e-6).
    """
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] < 2:
        raise ValueError(f"probabilities must be (n, V) with V >= 2, got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("probabilities hold NaN, inf or negative entries")
    if p.size and np.abs(p.sum(1) - 1.0).max() > 1e-6:
        raise ValueError("probability rows must sum to 1")
    V = p.shape[1]
    return (1.0 - V * floor) * p + floor


def ideal_bits(symbols: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Information content ``-log2 p[i, symbols[i]]`` of each symbol (float64)."""
    symbols = np.asarray(symbols, dtype=np.int64)
    return -np.log2(p[np.arange(len(symbols)), symbols])


class RangeWriter:
    """Appends symbols with per-symbol categorical models; :meth:`payload` gives the bytes."""

    def __init__(self) -> None:
        c = _constriction()
        self._enc = c.stream.queue.RangeEncoder()
        self._family = c.stream.model.Categorical(perfect=False)
        self.symbols = 0

    def encode(self, symbols: np.ndarray, p: np.ndarray) -> None:
        """Encode ``symbols (n,)`` in ``0..V-1`` with probabilities ``p (n, V)`` (already floored)."""
        symbols = np.ascontiguousarray(symbols, dtype=np.int32)
        p = np.ascontiguousarray(p, dtype=np.float64)
        if p.shape[0] != symbols.shape[0]:
            raise ValueError(f"{symbols.shape[0]} symbols but {p.shape[0]} probability rows")
        if symbols.size and (symbols.min() < 0 or symbols.max() >= p.shape[1]):
            raise ValueError(f"symbols must lie in 0..{p.shape[1] - 1}")
        if symbols.size and (p[np.arange(len(symbols)), symbols] <= 0).any():
            raise ValueError("an occurring symbol has probability 0 (the probability floor is missing)")
        if symbols.size:
            self._enc.encode(symbols, self._family, p)
        self.symbols += int(symbols.size)

    def payload(self) -> bytes:
        words = np.asarray(self._enc.get_compressed(), dtype=np.uint32)
        return words.astype(">u4").tobytes().rstrip(b"\x00")


class RangeReader:
    """Decodes what a :class:`RangeWriter` wrote, given the same probability rows in the same order."""

    def __init__(self, payload: bytes) -> None:
        c = _constriction()
        pad = (-len(payload)) % 4
        words = np.frombuffer(payload + b"\x00" * pad, dtype=">u4").astype(np.uint32)
        self._dec = c.stream.queue.RangeDecoder(words)
        self._family = c.stream.model.Categorical(perfect=False)

    def decode(self, p: np.ndarray) -> np.ndarray:
        p = np.ascontiguousarray(p, dtype=np.float64)
        if p.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        try:
            out = self._dec.decode(self._family, p)
        except (AssertionError, ValueError, RuntimeError) as e:
            raise BitstreamError(f"the payload does not decode ({e}); the file is corrupted or was "
                                 f"written by another model") from None
        return np.asarray(out, dtype=np.int64)


@dataclass(frozen=True)
class Header:
    """The fields of an ARPC header (see the module docstring)."""

    num_scales: int
    channels: int
    entropy_model: str
    model_hash: bytes
    height: int
    width: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_scales <= 15:
            raise ValueError(f"Header.num_scales must be in 1..15, got {self.num_scales}")
        if self.channels not in (1, 3):
            raise ValueError(f"Header.channels must be 1 or 3, got {self.channels}")
        if self.entropy_model not in ENTROPY_MODELS:
            raise ValueError(f"Header.entropy_model must be one of {ENTROPY_MODELS}, got {self.entropy_model!r}")
        if len(self.model_hash) != 4:
            raise ValueError(f"Header.model_hash must be 4 bytes, got {len(self.model_hash)}")
        for name in ("height", "width"):
            v = getattr(self, name)
            if not 1 <= v <= _MAX_SIDE:
                raise ValueError(f"Header.{name} must be in 1..{_MAX_SIDE}, got {v}")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(blob: bytes, pos: int, what: str) -> tuple[int, int]:
    n = shift = 0
    for i in range(3):
        if pos + i >= len(blob):
            raise BitstreamError(f"truncated ARPC header (ends inside the image {what})")
        b = blob[pos + i]
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, pos + i + 1
    raise BitstreamError(f"corrupted ARPC header (the image {what} is longer than 3 bytes)")


def pack(header: Header, payload: bytes) -> bytes:
    """Header bytes + payload, with the CRC-32 over both."""
    flags = (header.channels - 1) | (ENTROPY_MODELS.index(header.entropy_model) << 2)
    head = MAGIC + bytes([(VERSION << 4) | header.num_scales, flags]) + header.model_hash
    head += _varint(header.height) + _varint(header.width)
    crc = zlib.crc32(payload, zlib.crc32(head)) & 0xFFFFFFFF
    return head + crc.to_bytes(4, "big") + payload


def header_size(header: Header) -> int:
    return 8 + len(_varint(header.height)) + len(_varint(header.width)) + 4


def unpack(blob: bytes) -> tuple[Header, bytes]:
    """``(header, payload)`` of an ARPC file; :class:`BitstreamError` (one line) if it is not one,
    is truncated or corrupted, or has an unknown version."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"an ARPC bitstream is bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < 2 or blob[:2] != MAGIC:
        raise BitstreamError("not an ARPC bitstream (the file does not start with b'AR')")
    if len(blob) < 8:
        raise BitstreamError(f"truncated ARPC header ({len(blob)} bytes)")
    version, k = blob[2] >> 4, blob[2] & 0x0F
    if version != VERSION:
        raise BitstreamError(f"ARPC format version {version} is not supported (this rankwise reads version {VERSION})")
    flags = blob[3]
    if flags >> 3 or (flags & 3) not in (0, 2) or k == 0:
        raise BitstreamError("corrupted ARPC header (invalid flag bits)")
    height, pos = _read_varint(blob, 8, "height")
    width, pos = _read_varint(blob, pos, "width")
    if len(blob) < pos + 4:
        raise BitstreamError("truncated ARPC header (no checksum)")
    crc = int.from_bytes(blob[pos:pos + 4], "big")
    payload = blob[pos + 4:]
    if zlib.crc32(payload, zlib.crc32(blob[:pos])) & 0xFFFFFFFF != crc:
        raise BitstreamError("the ARPC bitstream is truncated or corrupted (checksum mismatch)")
    try:
        header = Header(num_scales=k, channels=(flags & 3) + 1, entropy_model=ENTROPY_MODELS[(flags >> 2) & 1],
                        model_hash=blob[4:8], height=height, width=width)
    except ValueError as e:
        raise BitstreamError(f"corrupted ARPC header ({e})") from None
    return header, payload
