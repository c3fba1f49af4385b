"""Wire formats: how a learner's fragment crosses the wire to the syncer (NumPy only, pure).

A :class:`WireFormat` turns a mapping ``name → float32 array`` into a *payload* (the tensors that
are actually stored or sent) and back. The formats, chosen by name (``diloco.wire.dtype``):

========== ==================================== ============================== ==========================
dtype      payload per tensor x (n values)      bytes                          |decoded − x|
========== ==================================== ============================== ==========================
float32    ``<name>``: x itself, as given       4n                             0 (bit-exact)
bfloat16   ``<name>``: uint16 [x.shape], the    2n                             ≤ 2⁻⁸·|x| (round to nearest
           bfloat16 bit patterns                                               even, 8 significant bits)
int8       ``<name>``: int8 [x.shape] codes in  n + 4·⌈n/b⌉                    ≤ absmax/127/2 per block
           [−127, 127]; ``<name>@scale``:
           float32 [⌈n/b⌉]
int4       ``<name>``: uint8 [⌈n/2⌉], two codes ⌈n/2⌉ + 4·⌈n/b⌉                ≤ absmax/7/2 per block
           in [−7, 7] per byte; ``<name>@scale``:
           float32 [⌈n/b⌉]
========== ==================================== ============================== ==========================

**Blocks.** int8 and int4 quantise x flattened (C order) in blocks of ``block_size`` (b) values,
the last one shorter when b does not divide n; ``block_size=None`` is one block per tensor
(b = n, one scale). Each block has its own scale s = absmax/q (q = 127 or 7, absmax = max |x| over
the block, s rounded to float32), codes c = round(x/s) (round half to even), clipped to [−q, q],
and decodes to c·s in float32. So |c·s − x| ≤ s/2 = absmax/(2q) per block, up to the float32
rounding of the product (relative 2⁻²⁴) and while s is a normal float32 (absmax ≥ q·1.2e−38).
A block of zeros has s = 0 and decodes to exact zeros.

**int4 packing.** The codes of the whole tensor (not per block), two per byte: value 2i in the low
nibble, 2i + 1 in the high one, each as a 4-bit two's complement number; an odd count pads one
zero code. Symmetric: −8 is never produced (decoded faithfully if a payload holds it).

**Non-finite values stay detectable.** A NaN or ±inf in a block makes its absmax, hence its scale,
non-finite, and every value of that block decodes to NaN or ±inf (int8, int4); bfloat16 keeps
NaN and ±inf as they are. A syncer checking the decoded values for finiteness therefore still
catches a learner that diverged; nothing decodes to finite garbage.

**What the learner encodes** (``diloco.learner``, ``diloco.syncer``): with float32 its fragment
θ_{m,p} exactly as before; with the others its update Δ = θ_{m,p} − Θ_base relative to the global
fragment it last received, which the syncer adds back to its own copy of Θ_base. Publishing
(syncer → learners) is always float32.

A format is written as a *spec* string in submissions and manifests: ``"int8"`` (per tensor) or
``"int8:64"`` (blocks of 64); :meth:`WireFormat.parse` reads it back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

WIRE_DTYPES = ("float32", "bfloat16", "int8", "int4")
SCALE_SUFFIX = "@scale"  # tensor names are "/"-separated paths and never hold "@"
_QMAX = {"int8": 127, "int4": 7}


def _blocks(n: int, block_size: int | None) -> tuple[int, int]:
    """``(b, number of blocks)`` for n values: b = n (at least 1) per tensor."""
    b = block_size or max(n, 1)
    return b, math.ceil(n / b)


@dataclass(frozen=True)
class WireFormat:
    """One wire format: ``dtype`` in :data:`WIRE_DTYPES` and, for int8/int4, ``block_size`` values
    per scale (None: one scale per tensor). Raises ``ValueError`` for an unknown dtype, a
    ``block_size`` < 1, or a ``block_size`` with float32/bfloat16 (they have no scales)."""

    dtype: str = "float32"
    block_size: int | None = None

    def __post_init__(self):
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {self.dtype!r}; choose one of {', '.join(WIRE_DTYPES)}")
        if self.block_size is not None:
            if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
                raise ValueError(f"wire block_size must be a positive int or None, got {self.block_size!r}")
            if self.dtype not in _QMAX:
                raise ValueError(f"wire block_size applies to int8 and int4 only, not {self.dtype}")

    # -- names ------------------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """``"int8"`` or ``"int8:64"``: the name written into submissions (:meth:`parse` inverts it)."""
        return self.dtype if self.block_size is None else f"{self.dtype}:{self.block_size}"

    @classmethod
    def parse(cls, spec: str) -> WireFormat:
        """The format of a spec string (``"float32"``, ``"int4"``, ``"int4:64"``). ``ValueError`` if
        it is not one."""
        dtype, _, block = str(spec).partition(":")
        if block and not block.isdigit():
            raise ValueError(f"wire format {spec!r}: block size {block!r} is not a positive integer")
        return cls(dtype, int(block) if block else None)

    @property
    def sends_delta(self) -> bool:
        """True when learners send Δ = θ − Θ_base (every format but float32, which sends θ)."""
        return self.dtype != "float32"

    # -- sizes ------------------------------------------------------------------------------------
    def layout(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[np.dtype | None, tuple[int, ...]]]:
        """Payload tensor name → (dtype, shape) for tensors of ``shapes`` (dtype None for float32:
        whatever the sender had, float32 in practice)."""
        out: dict[str, tuple[np.dtype | None, tuple[int, ...]]] = {}
        for name, shape in shapes.items():
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape)
            if self.dtype == "float32":
                out[name] = (None, shape)
            elif self.dtype == "bfloat16":
                out[name] = (np.dtype(np.uint16), shape)
            else:
                codes = (np.dtype(np.int8), shape) if self.dtype == "int8" else (np.dtype(np.uint8), ((n + 1) // 2,))
                out[name] = codes
                out[name + SCALE_SUFFIX] = (np.dtype(np.float32), (_blocks(n, self.block_size)[1],))
        return out

    def payload_nbytes(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """Bytes of the payload for tensors of ``shapes`` (float32 counted at 4 bytes a value)."""
        return int(
            sum(math.prod(shape) * (4 if dt is None else dt.itemsize) for dt, shape in self.layout(shapes).values())
        )

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The payload of ``tensors`` (name → float32 array of any shape): see the module table.
        float32 returns the very arrays given (no copy). Raises ``ValueError`` if a name holds
        ``"@"`` (it would collide with a scale)."""
        if self.dtype == "float32":
            return dict(tensors)
        out: dict[str, np.ndarray] = {}
        for name, x in tensors.items():
            if "@" in name:
                raise ValueError(f"tensor name {name!r} holds '@', which the wire formats reserve for scales")
            x = np.asarray(x, dtype=np.float32)
            if self.dtype == "bfloat16":
                out[name] = x.astype(ml_dtypes.bfloat16).view(np.uint16)
                continue
            codes, scale = _quantise(x.reshape(-1), _QMAX[self.dtype], self.block_size)
            out[name + SCALE_SUFFIX] = scale
            out[name] = codes.reshape(x.shape) if self.dtype == "int8" else _pack_int4(codes)
        return out

    def check(self, payload: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise ``ValueError`` naming the first difference if ``payload`` is not this format's
        payload of tensors of ``shapes`` (tensor names, dtypes, shapes)."""
        want = self.layout(shapes)
        if set(payload) != set(want):
            missing, extra = sorted(set(want) - set(payload)), sorted(set(payload) - set(want))
            raise ValueError(f"{self.spec} payload: missing {missing}, unexpected {extra}")
        for key, (dt, shape) in want.items():
            a = payload[key]
            if tuple(a.shape) != shape or (dt is not None and a.dtype != dt):
                raise ValueError(
                    f"{self.spec} payload {key!r}: {a.dtype}{list(a.shape)}, expected {dt or 'float'}{list(shape)}"
                )

    def decode(self, payload: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The tensors of ``payload``: name → float32 array of ``shapes[name]``; float32 returns the
        payload's arrays as they are (no copy, no cast: bit-identical to what was sent). Raises
        ``ValueError`` (from :meth:`check`) for a payload of another layout."""
        self.check(payload, shapes)
        if self.dtype == "float32":
            return {name: payload[name] for name in shapes}
        out = {}
        for name, shape in shapes.items():
            shape = tuple(int(d) for d in shape)
            if self.dtype == "bfloat16":
                out[name] = (payload[name].astype(np.uint32) << 16).view(np.float32)
                continue
            n = math.prod(shape)
            codes = payload[name].reshape(-1) if self.dtype == "int8" else _unpack_int4(payload[name], n)
            out[name] = _dequantise(codes, payload[name + SCALE_SUFFIX], self.block_size, n).reshape(shape)
        return out

    def error_bound(self, x: np.ndarray) -> np.ndarray:
        """The largest |decoded − x| this format allows for each value of ``x`` (float64, x's shape;
        before the float32 rounding of the decoded product): 0, 2⁻⁸·|x|, or absmax/(2q) of its block."""
        x = np.asarray(x, dtype=np.float64)
        if self.dtype == "float32":
            return np.zeros_like(x)
        if self.dtype == "bfloat16":
            return np.abs(x) * 2.0**-8
        flat = np.abs(x.reshape(-1))
        b, k = _blocks(flat.size, self.block_size)
        padded = np.zeros(k * b)
        padded[: flat.size] = flat
        absmax = padded.reshape(k, b).max(axis=1) if k else padded
        return (np.repeat(absmax, b)[: flat.size] / (2 * _QMAX[self.dtype])).reshape(x.shape)


def _quantise(flat: np.ndarray, qmax: int, block_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax codes (int8, in [−qmax, qmax]) and per-block float32 scales of ``flat``."""
    n = flat.size
    b, k = _blocks(n, block_size)
    padded = np.zeros(k * b, np.float32)
    padded[:n] = flat
    rows = padded.reshape(k, b)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        absmax = np.max(np.abs(rows), axis=1) if k else np.zeros(0, np.float32)  # NaN propagates
        scale = (absmax.astype(np.float64) / qmax).astype(np.float32)
        q = rows.astype(np.float64) / scale.astype(np.float64)[:, None]
        q = np.where(np.isfinite(q), np.rint(q), 0.0)  # 0/0 (a zero block) and x/NaN, x/inf → code 0
    codes = np.clip(q, -qmax, qmax).astype(np.int8).reshape(-1)[:n]
    return codes, scale


def _dequantise(codes: np.ndarray, scale: np.ndarray, block_size: int | None, n: int) -> np.ndarray:
    """codes·scale of its block, float32 [n]: a non-finite scale gives NaN/±inf for the whole block."""
    b, _ = _blocks(n, block_size)
    with np.errstate(invalid="ignore", over="ignore"):
        return codes.astype(np.float32) * np.repeat(scale.astype(np.float32), b)[:n]


def _pack_int4(codes: np.ndarray) -> np.ndarray:
    """int8 codes in [−8, 7] → uint8 [⌈n/2⌉]: value 2i in the low nibble, 2i + 1 in the high one."""
    nib = codes.astype(np.uint8) & 0x0F
    if nib.size % 2:
        nib = np.concatenate([nib, np.zeros(1, np.uint8)])
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)


def _unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`_pack_int4`: int8 codes [n] (4-bit two's complement, sign-extended)."""
    nib = np.empty(packed.size * 2, np.uint8)
    nib[0::2], nib[1::2] = packed & 0x0F, packed >> 4
    return ((nib[:n].astype(np.int16) ^ 8) - 8).astype(np.int8)
