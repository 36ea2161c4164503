"""A GGUF tensor's blocks, decoded to one form every kept type shares:

    weight[n, k] = scales[n, g] * (codes[n, k] - zero) + minimums[n, g],   g = k // group

with integer codes, one integer zero point for the whole tensor, and float32 scales and minimums per group of
``group`` weights along k. Every product and sum is the one gguf's own ``dequantize`` computes in float32, so
``dequantize(decode(...))`` equals it bit for bit (tests/test_kernels.py):

    type   bits  group  codes q           zero  scale        minimum        bytes / block
    Q4_0   4     32     0..15             8     d            -              18 per 32
    Q4_1   4     32     0..15             0     d            m              20 per 32
    Q5_0   5     32     0..31             16    d            -              22 per 32
    Q5_1   5     32     0..31             0     d            m              24 per 32
    Q8_0   8     32     -128..127 (int8)  0     d            -              34 per 32
    Q4_K   4     32     0..15             0     d * sc_j     -dmin * mn_j   144 per 256
    Q5_K   5     32     0..31             0     d * sc_j     -dmin * mn_j   176 per 256
    Q6_K   6     16     0..63             32    d * sc_j     -              210 per 256

The K-quants' d * sc_j (fp16 times a 6-bit or int8 scale) and dmin * mn_j are exact in float32, so one float
scale per group loses nothing. Q8_0's codes are signed (``signed``); every other type's are unsigned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# type -> (bits, group, weights per block, bytes per block)
FORMATS = {
    "Q4_0": (4, 32, 32, 18), "Q4_1": (4, 32, 32, 20), "Q5_0": (5, 32, 32, 22), "Q5_1": (5, 32, 32, 24),
    "Q8_0": (8, 32, 32, 34), "Q4_K": (4, 32, 256, 144), "Q5_K": (5, 32, 256, 176), "Q6_K": (6, 16, 256, 210),
}
TYPES = tuple(FORMATS)


@dataclass(frozen=True)
class Blocks:
    codes: np.ndarray            # [n, k] uint8 (int8 where ``signed``)
    scales: np.ndarray           # [n, k / group] float32
    minimums: np.ndarray | None  # [n, k / group] float32, or None
    zero: int
    bits: int
    group: int
    type_name: str

    @property
    def signed(self) -> bool:
        return self.codes.dtype == np.int8

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def take_rows(self, rows: np.ndarray) -> "Blocks":
        return Blocks(self.codes[rows], self.scales[rows], None if self.minimums is None else self.minimums[rows],
                      self.zero, self.bits, self.group, self.type_name)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 of the fp16 they hold."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-weight block, ggml's order (weight j in byte j's low nibble, j + 16 in its high
    nibble) -> its 32 codes [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and minimums [nb, 12] -> (sc [nb, 8], mn [nb, 8]) as integers."""
    sc = np.empty((b.shape[0], 8), np.uint8)
    mn = np.empty((b.shape[0], 8), np.uint8)
    sc[:, :4], mn[:, :4] = b[:, 0:4] & 63, b[:, 4:8] & 63
    sc[:, 4:] = (b[:, 8:12] & 0x0F) | ((b[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)
    return sc, mn


def check_shape(type_name: str, n: int, k: int) -> None:
    if type_name not in FORMATS:
        raise ValueError(f"GGUF type {type_name} has no kernel; supported: {', '.join(TYPES)}")
    per_block = FORMATS[type_name][2]
    if k % per_block:
        raise ValueError(f"a {type_name} tensor's input size must be a multiple of {per_block}, got {k}")


def decode(type_name: str, raw: np.ndarray, n: int, k: int) -> Blocks:
    """One tensor's bytes as the file stores them ([n, bytes per row], or flat) -> its Blocks."""
    check_shape(type_name, n, k)
    bits, group, per_block, nbytes = FORMATS[type_name]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.size != n * (k // per_block) * nbytes:
        raise ValueError(f"{type_name} [{n}, {k}] takes {n * (k // per_block) * nbytes} bytes, got {raw.size}")
    b = raw.reshape(n * (k // per_block), nbytes)
    minimums = None
    if type_name in ("Q4_0", "Q4_1"):
        off = 2 if type_name == "Q4_0" else 4
        codes, scales, zero = _nibbles(b[:, off:]), _f16(b[:, 0:2]), 8 if type_name == "Q4_0" else 0
        if type_name == "Q4_1":
            minimums = _f16(b[:, 2:4])
    elif type_name in ("Q5_0", "Q5_1"):
        off = 2 if type_name == "Q5_0" else 4
        high = (b[:, off:off + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        codes = _nibbles(b[:, off + 4:]) | (high.astype(np.uint8) << 4)
        scales, zero = _f16(b[:, 0:2]), 16 if type_name == "Q5_0" else 0
        if type_name == "Q5_1":
            minimums = _f16(b[:, 2:4])
    elif type_name == "Q8_0":
        codes, scales, zero = b[:, 2:].view(np.int8), _f16(b[:, 0:2]), 0
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        scales = d[:, None] * sc.astype(np.float32)     # [nb, 8], exact
        minimums = -(dmin[:, None] * mn.astype(np.float32))
        if type_name == "Q4_K":
            qs = b[:, 16:].reshape(-1, 4, 1, 32)  # 4 x 32 bytes: sub-blocks 2j (low nibbles) and 2j + 1 (high)
            codes = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 256)
        else:
            qh = b[:, 16:48].reshape(-1, 1, 32)   # bit j of byte l: the fifth bit of sub-block j's weight l
            qs = b[:, 48:].reshape(-1, 4, 1, 32)
            low = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
            high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            codes = (low | (high << 4)).reshape(-1, 256)
        zero = 0
    else:  # Q6_K: ql [128], qh [64], int8 scales [16], d
        ql = b[:, 0:128].reshape(-1, 2, 1, 64)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32)
        low = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 2, 4, 32)
        high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 2, 4, 32)
        codes = (low | (high << 4)).reshape(-1, 256)
        scales = _f16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)  # [nb, 16], exact
        zero = 32
    g = k // group
    return Blocks(np.ascontiguousarray(codes.reshape(n, k)), np.ascontiguousarray(scales, np.float32).reshape(n, g),
                  None if minimums is None else np.ascontiguousarray(minimums, np.float32).reshape(n, g),
                  zero, bits, group, type_name)


def dequantize(blocks: Blocks) -> np.ndarray:
    """The float32 weights [n, k]: scale * (code - zero) [+ minimum], in gguf's own float32 arithmetic."""
    n, k = blocks.shape
    q = blocks.codes.reshape(n, k // blocks.group, blocks.group).astype(np.float32) - np.float32(blocks.zero)
    w = blocks.scales[..., None] * q
    if blocks.minimums is not None:
        w = w + blocks.minimums[..., None]
    return w.reshape(n, k)
