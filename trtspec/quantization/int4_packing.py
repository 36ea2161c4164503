"""How 4-bit (and 8-bit) weight codes are laid out in bytes for onnxruntime's MatMulNBits: its input B is
[N, K / block, block * bits / 8] uint8, codes along K, two 4-bit codes a byte with the lower K index in the low
nibble. Written once here for every producer: the INT4 passes' signed codes (builder/ort_lowering.py) and a GGUF
file's own codes (exporter/gguf.py)."""

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
