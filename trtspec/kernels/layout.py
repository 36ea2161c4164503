"""The kernels' layout of a GGUF tensor (csrc/gguf_linear.h says it byte by byte): written once, at build time.

Output columns in panels of 16; per panel, every group of G weights along K in order, each group its codes (16
columns x G, a column's 4 consecutive k in one int32 lane), then the 16 columns' scales, then their minimums where
the type has them: float16 where every scale and minimum of the tensor is one exactly (the legacy types, whose d and
m are the file's float16), else float32 (a K-quant's d * sc). Codes keep their bits: two 4-bit codes a byte, 5- and
6-bit codes as a nibble plus a plane of their high bits, Q8_0's bytes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .blocks import Blocks

PANEL = 16


@dataclass(frozen=True)
class Packed:
    """A layer in the kernels' layout: ``data`` (uint8, flat) and what the kernel needs to read it."""
    data: np.ndarray
    n: int
    k: int
    bits: int
    group: int
    zero: int
    has_min: bool
    type_name: str
    half_scales: bool = False  # scales and minimums stored as float16 (exactly), not float32

    @property
    def codes_bytes(self) -> int:
        return codes_bytes(self.bits, self.group)

    @property
    def floats_bytes(self) -> int:
        """A group's 16 scales (or minimums)."""
        return PANEL * (2 if self.half_scales else 4)

    @property
    def group_bytes(self) -> int:
        return self.codes_bytes + self.floats_bytes * (2 if self.has_min else 1)


def codes_bytes(bits: int, group: int) -> int:
    steps = group // 4
    return {4: steps // 2 * 64, 5: steps // 2 * 64 + 64, 6: steps // 2 * 64 + 64, 8: steps * 64}[bits]


def pack(blocks: Blocks, half_scales: bool | None = None) -> Packed:
    """Blocks (blocks.decode) -> Packed; ``half_scales``: float16 scales and minimums (None: wherever exact)."""
    n, k = blocks.shape
    g, bits = blocks.group, blocks.bits
    steps, groups = g // 4, k // g
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    codes = np.pad(blocks.codes.view(np.uint8), ((0, pad), (0, 0)))
    # [panel, column, group, step, t] -> [panel, group, step, column, t]: a step's 64 bytes, byte c*4 + t
    steps_of = codes.reshape(panels, PANEL, groups, steps, 4).transpose(0, 2, 3, 1, 4).reshape(panels, groups, steps, 64)
    if bits == 8:
        parts = [steps_of.reshape(panels, groups, steps * 64)]
    else:
        low = steps_of & 0x0F
        half = steps // 2
        parts = [(low[:, :, :half] | (low[:, :, half:] << 4)).reshape(panels, groups, half * 64)]
        if bits > 4:
            width = bits - 4  # high bits a step: 1 (5-bit, 8 steps) or 2 (6-bit, 4 steps) fill a byte
            assert width * steps == 8, (bits, g)
            high = (steps_of >> 4).astype(np.uint16)
            plane = sum(high[:, :, s] << (width * s) for s in range(steps)).astype(np.uint8)
            parts.append(plane)

    kept = [v for v in (blocks.scales, blocks.minimums) if v is not None]
    exact = all(np.array_equal(v.astype(np.float16).astype(np.float32), v) for v in kept)
    if half_scales and not exact:
        raise ValueError(f"{blocks.type_name}'s scales or minimums are not all float16 numbers; pack them as float32")
    half = exact if half_scales is None else half_scales

    def floats(v: np.ndarray) -> np.ndarray:  # [n, groups] -> [panels, groups, 16 x 2 or 4 bytes]
        v = np.pad(v.astype(np.float16 if half else np.float32), ((0, pad), (0, 0)))
        return np.ascontiguousarray(v.reshape(panels, PANEL, groups).transpose(0, 2, 1)).view(np.uint8)

    parts += [floats(v) for v in kept]
    data = np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1)
    return Packed(data, n, k, bits, g, blocks.zero, blocks.minimums is not None, blocks.type_name, half)


def unpack(p: Packed) -> Blocks:
    """Packed -> the Blocks it holds (pack's inverse; the pure-torch path and the tests read it)."""
    steps, groups = p.group // 4, p.k // p.group
    panels = -(-p.n // PANEL)
    data = p.data.reshape(panels, groups, p.group_bytes)
    cb = p.codes_bytes
    if p.bits == 8:
        steps_of = data[:, :, :cb].reshape(panels, groups, steps, 64)
    else:
        half = steps // 2
        nib = data[:, :, : half * 64].reshape(panels, groups, half, 64)
        steps_of = np.concatenate([nib & 0x0F, nib >> 4], axis=2)
        if p.bits > 4:
            width = p.bits - 4
            plane = data[:, :, half * 64: half * 64 + 64]
            high = np.stack([(plane >> (width * s)) & ((1 << width) - 1) for s in range(steps)], axis=2)
            steps_of = steps_of | (high << 4)
    codes = steps_of.reshape(panels, groups, steps, PANEL, 4).transpose(0, 3, 1, 2, 4).reshape(panels * PANEL, p.k)

    def floats(at: int) -> np.ndarray:
        v = np.ascontiguousarray(data[:, :, at:at + p.floats_bytes]).view(np.float16 if p.half_scales else np.float32)
        return v.astype(np.float32).transpose(0, 2, 1).reshape(panels * PANEL, groups)[: p.n]  # [panels, groups, 16]

    codes = codes[: p.n]
    return Blocks(np.ascontiguousarray(codes.view(np.int8) if p.bits == 8 else codes), floats(cb),
                  floats(cb + p.floats_bytes) if p.has_min else None, p.zero, p.bits, p.group, p.type_name)
