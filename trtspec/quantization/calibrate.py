"""Calibration: run the unquantized step graph through onnxruntime on text and record MatMul inputs.

Text comes from a file (``--calib-file``) or, by default, the held-out text
shipped in ``calibration.json``. It is tokenized with the export's own
tokenizer, cut into windows of ``seq_len`` tokens, and each window runs as one
prefill call (batch 1, empty cache). Everything is in a fixed order, so the
same text gives the same statistics and the same quantized graph.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TrtspecError

DEFAULT_TEXT = Path(__file__).with_name("calibration.json")
log = logging.getLogger("trtspec.quantize")


class CalibrationError(TrtspecError, ValueError):
    """The calibration text is missing, empty or unreadable."""


@dataclass
class ActivationStats:
    """What calibration saw at one MatMul input x [.., K]."""

    absmax: np.ndarray  # [K] max |x| per channel
    mean_abs: np.ndarray  # [K] mean |x| per channel
    rows: np.ndarray  # [R, K] rows of x spread evenly over the calibration windows (AWQ's search data)
    xtx: np.ndarray | None = None  # [K, K] sum of x^T x over every calibration token (GPTQ's Hessian), if asked


def load_texts(path: str | Path | None) -> tuple[list[str], dict]:
    """The calibration texts and a description of where they came from (path and sha256 of the file).

    A .json file holds a list of strings, or an object with a "texts" (or "prompts")
    list of strings or {"text"/"prompt": ...} objects; a .jsonl file one such item
    per line; any other file is plain text used whole.
    """
    path = Path(path) if path is not None else DEFAULT_TEXT
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist; pass a text, .json or .jsonl file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text") from None
    if path.suffix in (".json", ".jsonl"):
        try:
            items = ([json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl"
                     else json.loads(text) if text.strip() else [])
        except json.JSONDecodeError as e:
            raise CalibrationError(f"calibration file {path} is not valid JSON ({e})") from None
        if isinstance(items, dict):
            items = items.get("texts", items.get("prompts", []))
        texts = [_text_of(item, path) for item in items]
    else:
        texts = [text]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError(f"calibration file {path} has no text; give it at least one non-empty prompt")
    source = "default (trtspec/quantization/calibration.json)" if path == DEFAULT_TEXT else str(path.resolve())
    return texts, {"file": source, "file_sha256": hashlib.sha256(raw).hexdigest()}


def _text_of(item, path: Path) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("text", "prompt"):
            if isinstance(item.get(key), str):
                return item[key]
    raise CalibrationError(f"calibration file {path}: expected strings or {{\"text\": ...}} objects, got {item!r:.80}")


def token_windows(texts: list[str], tokenizer, samples: int, seq_len: int) -> list[np.ndarray]:
    """The first ``samples`` windows of up to seq_len tokens, each text cut into consecutive windows."""
    windows = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        for start in range(0, len(ids), seq_len):
            window = ids[start : start + seq_len]
            if len(window) >= 2:
                windows.append(np.asarray(window, dtype=np.int64))
            if len(windows) == samples:
                return windows
    if not windows:
        raise CalibrationError("the calibration text tokenizes to fewer than 2 tokens; give it more text")
    return windows


def windows_sha256(windows: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(len(w).to_bytes(8, "little"))
        h.update(w.astype("<i8").tobytes())
    return h.hexdigest()


def collect(graph_path: Path, model: dict, value_names: list[str], windows: list[np.ndarray],
            max_rows: int = 2048, hessian: bool = False) -> dict[str, ActivationStats]:
    """Run every window through the graph and return statistics of the named values (MatMul inputs);
    with ``hessian`` also each value's x^T x over all calibration tokens."""
    import onnx_ir as ir
    import onnxruntime as ort

    from ..engines.onnxruntime import session_options

    probe = ir.load(graph_path)
    values = {v.name: v for node in probe.graph for v in node.outputs}
    probe.graph.outputs.extend(values[name] for name in value_names)
    with tempfile.TemporaryDirectory(prefix="trtspec-calibrate-") as tmp:
        path = Path(tmp) / "probe.onnx"
        ir.save(probe, path, external_data="probe.onnx.data" if model["weight_bytes"] > (1 << 30) else None)
        del probe
        session = ort.InferenceSession(str(path), session_options(None), providers=["CPUExecutionProvider"])
    dtype = np.float16 if model["dtype"] == "float16" else np.float32
    cache = np.zeros((1, model["num_kv_heads"], model["max_seq_len"], model["head_dim"]), dtype)
    feeds = {name: cache for name in model["inputs"][2:]}
    per_window = math.ceil(max_rows / len(windows))
    absmax, abssum, rows, xtx = {}, {}, {name: [] for name in value_names}, {}
    count, t0, last = 0, time.perf_counter(), 0.0
    for i, ids in enumerate(windows):
        feeds["input_ids"] = ids[None]
        feeds["position_ids"] = np.arange(len(ids), dtype=np.int64)[None]
        outputs = session.run(value_names, feeds)
        for name, x in zip(value_names, outputs):
            x = x.reshape(-1, x.shape[-1]).astype(np.float32)
            a = np.abs(x)
            absmax[name] = np.maximum(absmax[name], a.max(axis=0)) if name in absmax else a.max(axis=0)
            abssum[name] = abssum.get(name, 0.0) + a.sum(axis=0, dtype=np.float64)
            take = np.unique(np.linspace(0, len(x) - 1, min(per_window, len(x))).astype(int))
            rows[name].append(x[take])
            if hessian:
                x64 = x.astype(np.float64)
                xtx[name] = xtx.get(name, 0.0) + x64.T @ x64
        count += len(ids)
        now = time.perf_counter()
        if now - last > 2.0 or i + 1 == len(windows):
            log.info("calibrating: %d/%d windows, %d tokens (%.0f s)", i + 1, len(windows), count, now - t0)
            last = now
    return {
        name: ActivationStats(absmax[name], (abssum[name] / count).astype(np.float32), np.concatenate(rows[name]),
                              xtx.get(name))
        for name in value_names
    }
