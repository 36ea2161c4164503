"""Numpy references for the quantization tests, written independently of trtspec.quantization.numerics."""

from __future__ import annotations

import json

import numpy as np

from trtspec import build, load_engine


MODES = ("int8-wo", "int8-sq", "fp8", "int4-rtn", "int4-awq", "int4-gptq")
CALIB = {"int8-sq": 8, "fp8": 8, "int4-awq": 8, "int4-gptq": 8}  # calibration windows: few, to keep the suite fast


def ref_int8(w):
    q, s = np.zeros(w.shape, np.int8), np.zeros(w.shape[1], np.float32)
    for n in range(w.shape[1]):
        s[n] = np.abs(w[:, n]).max() / 127
        q[:, n] = [max(-127, min(127, round(v / s[n]))) for v in w[:, n]]  # Python's round is half-to-even
    return q.astype(np.float32) * s


def ref_int4(w, block):
    out = np.zeros_like(w, dtype=np.float32)
    for b in range(0, w.shape[0], block):
        for n in range(w.shape[1]):
            col = w[b : b + block, n].astype(np.float32)
            s = np.float32(np.abs(col).max()) / np.float32(7) or np.float32(1)  # an all-zero block: any scale
            out[b : b + block, n] = [max(-8, min(7, round(float(v / s)))) * s for v in col]
    return out


def ref_e4m3(x):
    """Round to the nearest float8 E4M3FN value (ties to even), saturating at 448."""
    out = np.zeros_like(x, dtype=np.float64)
    for i, v in np.ndenumerate(x.astype(np.float64)):
        a = min(abs(v), 448.0)
        e = max(np.floor(np.log2(a)) if a > 0 else -6, -6)  # below 2^-6: subnormal spacing 2^-9
        step = 2.0 ** (e - 3)
        out[i] = np.sign(v) * round(a / step) * step
    return out


def ref_fp8(w):
    s = (np.abs(w).max(axis=0) / np.float32(448)).astype(np.float32)
    return (ref_e4m3(w / s) * s).astype(np.float32)


def step_logits(path, ids, *, fuse_qdq=False):
    """Logits [T, V] of one prefill call on a built onnxruntime engine."""
    quantized = "quantization" in json.loads((path / "manifest.json").read_text())
    options = {"fuse_qdq": False} if quantized and not fuse_qdq else {}
    engine = load_engine(build(path, path.parent / f"engine-{fuse_qdq}", **options))
    ids = np.asarray(ids, dtype=np.int64)
    return engine.forward(ids[None], np.arange(len(ids))[None])[0].copy()
