"""How 4-bit (and 8-bit) weight codes are laid out in bytes for onnxruntime's MatMulNBits: its input B is
[N, K / block, block * bits / 8] uint8, codes along K, two 4-bit codes a byte with the lower K index in the low
nibble. Written once here for every producer: the INT4 passes' signed codes (builder/ort_lowering.py,
builder/gguf_lowering.py) and a GGUF file's own codes (exporter/gguf.py). A bottom-layer module, so that the
exporter and the builder share it without importing each other's stages."""

from __future__ import annotations

import numpy as np


def pack_codes(codes: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """Unsigned codes [N, K] (0..15 for 4 bits, 0..255 for 8) -> MatMulNBits' B [N, K / block_size, block bytes]."""
    n, k = codes.shape
    codes = np.asarray(codes).astype(np.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.ascontiguousarray(codes.reshape(n, k // block_size, -1))


def unpack_codes(b: np.ndarray, bits: int) -> np.ndarray:
    """pack_codes' inverse: MatMulNBits' B [N, K / block, .] -> codes [N, K]."""
    n = b.shape[0]
    if bits == 8:
        return b.reshape(n, -1)
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, -1)


def pack_uint4(q: np.ndarray, block_size: int) -> np.ndarray:
    """Signed int4 q [N, K] (-8..7) -> MatMulNBits' B: q + 8, its default zero point, packed."""
    return pack_codes((q.astype(np.int16) + 8).astype(np.uint8), 4, block_size)


def pack_zero_points(zero_points: np.ndarray) -> np.ndarray:
    """4-bit zero points [N, blocks] -> MatMulNBits' zero_points: each row's codes two a byte, the lower block in
    the low nibble, a row's odd last block alone in its byte."""
    z = np.asarray(zero_points).astype(np.uint8)
    if z.shape[1] % 2:
        z = np.pad(z, ((0, 0), (0, 1)))
    return np.ascontiguousarray((z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1))


# A block of minimums takes this many 4-bit digits at most; one that needs more keeps its float MatMul
# (builder/gguf_lowering.py: gguf_linears). SmolLM2's centred Q4_1 remainders take 3 or 4 (25 and 185 of its 210 layers).
MAX_MINIMUM_DIGITS = 6


def minimum_digits(minimums: np.ndarray, block_size: int = 32) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Per-block minimums [N, G] (a GGUF layer's m, one for each of its K/32 blocks) -> 4-bit MatMulNBits
    blocks that hold them exactly: (codes [N, D * Gp], scales [N, D * Gp / block_size], D), zero point 8, with
    Gp = G padded to a multiple of block_size. Input j * Gp + g of those blocks is meant to carry block sum g, so
    that D copies of the block sums times these weights add sum_g m[n, g] * sum(block g of x).

    Each block of minimums of a row is c * 2^e, with integers c and e the coarsest power of two that leaves every
    c whole (float32 m: |c| < 2^24 times the block's spread of magnitudes). c is written in D balanced base-16
    digits v_j in [-8, 7], c = sum_j v_j 16^j; digit j's block has the scale 2^e * 16^j and the codes v_j + 8, so
    the weights it dequantizes to, summed over j, are m exactly. None where a block needs more than
    MAX_MINIMUM_DIGITS digits, or a scale falls outside float32."""
    m = np.asarray(minimums, np.float32)
    n, g = m.shape
    gp = -(-g // block_size) * block_size
    m = np.pad(m, ((0, 0), (0, gp - g))).reshape(n, gp // block_size, block_size)
    mantissa, exponent = np.frexp(m)  # m = mantissa * 2^exponent, |mantissa| in [0.5, 1): 24-bit integers below
    whole = np.rint(mantissa * 2.0 ** 24).astype(np.int64)
    bits = whole & -whole  # the lowest set bit of each integer mantissa
    low = np.where(whole != 0, exponent - 24 + np.log2(np.where(bits == 0, 1, np.abs(bits))).astype(np.int64), 1 << 20)
    e = low.min(-1, keepdims=True)
    e = np.where(e == 1 << 20, 0, e)  # an all-zero block: any scale
    shift = np.where(whole != 0, exponent - 24 - e, 0)  # c = whole * 2^shift (a negative shift drops zero bits)
    if shift.max(initial=0) > 4 * MAX_MINIMUM_DIGITS - 24:  # |whole| >= 2^23: c would need more digits
        return None
    c = np.where(shift >= 0, np.left_shift(np.abs(whole), np.maximum(shift, 0)),
                 np.right_shift(np.abs(whole), np.maximum(-shift, 0))) * np.sign(whole)
    digits, rest = [], c
    while rest.any() or not digits:
        if len(digits) == MAX_MINIMUM_DIGITS:
            return None
        v = (rest + 8) % 16 - 8
        digits.append(v)
        rest = (rest - v) // 16
    d = len(digits)
    scales = np.stack([np.ldexp(np.ones_like(e, np.float64), e + 4 * j) for j in range(d)], axis=1)  # [N, D, Gp/bs, 1]
    if not (np.all(scales >= 2.0 ** -149) and np.all(scales < 2.0 ** 127)):
        return None
    codes = np.stack(digits, axis=1) + 8  # [N, D, Gp / block_size, block_size]
    return (codes.reshape(n, d * gp).astype(np.uint8), scales.reshape(n, -1).astype(np.float32), d)
