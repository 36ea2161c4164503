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
    rows: object = None  # torch [R, K]: rows of x spread evenly over the calibration windows (AWQ's scale search)
    block_gram: object = None  # torch [K'/B, B, B]: x_b^T x_b per block of B inputs, every token (AWQ's clipping)
    xtx: object = None  # torch [K, K] float32: x^T x over every calibration token (GPTQ's Hessian)


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


class Calibration:
    """Calibration windows run through the step graph (onnxruntime), a pass per set of values asked for.

    Each pass builds a session of only the nodes the values asked for depend on (a pass over the first layers
    neither runs nor loads the rest, nor the lm_head). The graph's
    weights are read where they lie: the proto is loaded without its external data and onnxruntime reads
    that from the export directory.
    """

    def __init__(self, graph_path: Path, model: dict, windows: list[np.ndarray]):
        import onnx

        self.graph_path, self.model, self.windows = Path(graph_path), model, windows
        self.proto = onnx.load(str(graph_path), load_external_data=False)
        self.tokens = int(sum(map(len, windows)))

    def stats_bytes(self, k: int, *, rows: int = 0, block_size: int = 0, hessian: bool = False,
                    rows_dtype=None) -> int:
        """Memory the statistics of one value [.., K] take: what ``collect`` keeps until its pass ends."""
        from .numerics import padded_k

        kp = padded_k(k, block_size) if block_size else 0
        row_bytes = rows_dtype.itemsize if rows_dtype is not None else 4
        return (row_bytes * min(rows, self.tokens) * k + 4 * (kp * block_size + (k * k if hessian else 0))
                + 16 * k)

    def _session(self, value_names: list[str]):
        """A session computing only ``value_names``: the nodes they depend on and the weights those read."""
        import onnx
        import onnxruntime as ort

        from ..ort_session import session_options

        graph = self.proto.graph
        producer = {out: node for node in graph.node for out in node.output}
        needed, stack, keep = set(), list(value_names), set()
        while stack:
            name = stack.pop()
            node = producer.get(name)
            if node is None or id(node) in keep:
                continue
            keep.add(id(node))
            needed.update(node.input)
            stack.extend(i for i in node.input if i)
        pruned = onnx.helper.make_graph(
            [n for n in graph.node if id(n) in keep], graph.name, list(graph.input),
            [onnx.helper.make_empty_tensor_value_info(name) for name in value_names],
            [i for i in graph.initializer if i.name in needed])
        model = onnx.helper.make_model(pruned, opset_imports=self.proto.opset_import, ir_version=self.proto.ir_version,
                                       functions=list(self.proto.functions))
        options = session_options(None)
        options.enable_cpu_mem_arena = False  # the arena keeps a pass's peak of activations (~15 % of the weights)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(self.graph_path.parent))
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def collect(self, value_names: list[str], *, rows: int = 0, block_size: int = 0, hessian: bool = False,
                rows_dtype=None, what: str = "") -> dict[str, ActivationStats]:
        """Run every window and return statistics of the named values (MatMul inputs): |x| max and mean per
        channel; with ``rows`` that many rows of x spread over the windows (kept in ``rows_dtype``, default
        float32); with ``block_size`` each block's Gram matrix; with ``hessian`` x^T x. Accumulated in torch,
        float32 (sums of |x| in float64)."""
        import torch

        rows_dtype = rows_dtype or torch.float32

        from ..progress import Progress

        session = self._session(value_names)
        model = self.model
        dtype = np.float16 if model["dtype"] == "float16" else np.float32
        from ..exporter.contract import slots_by_input

        feeds = {past: np.zeros((1, model["num_kv_heads"], slots, model["head_dim"]), dtype)
                 for past, slots in slots_by_input(model).items()}
        per_window = math.ceil(rows / len(self.windows)) if rows else 0
        acc: dict[str, dict] = {name: {} for name in value_names}
        progress = Progress(f"calibrating{' ' + what if what else ''}", len(self.windows), "windows", log)
        for i, ids in enumerate(self.windows):
            feeds["input_ids"] = ids[None]
            feeds["position_ids"] = np.arange(len(ids), dtype=np.int64)[None]
            outputs = session.run(value_names, feeds)
            for name, out in zip(value_names, outputs):
                x = torch.from_numpy(out).reshape(-1, out.shape[-1]).to(torch.float32)
                _accumulate(acc[name], x, per_window, block_size, hessian, rows_dtype)
            progress.update(i + 1)
        progress.close()
        del session, outputs
        release_memory()
        return {
            name: ActivationStats(a["absmax"].numpy(), (a["abssum"] / self.tokens).numpy().astype(np.float32),
                                  torch.cat(a["rows"]) if rows else None, a.get("gram"), a.get("xtx"))
            for name, a in acc.items()
        }


def release_memory() -> None:
    """Give memory freed by Python and onnxruntime back to the system: glibc keeps freed heap blocks (its mmap
    threshold grows with large frees), so a finished onnxruntime session would otherwise stay in the RSS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _accumulate(a: dict, x, per_window: int, block_size: int, hessian: bool, rows_dtype) -> None:
    import torch

    from .numerics import block_gram

    absx = x.abs()
    a["absmax"] = torch.maximum(a["absmax"], absx.amax(dim=0)) if "absmax" in a else absx.amax(dim=0)
    a["abssum"] = a.get("abssum", 0.0) + absx.sum(dim=0, dtype=torch.float64)
    if per_window:
        take = np.unique(np.linspace(0, len(x) - 1, min(per_window, len(x))).astype(int))
        a.setdefault("rows", []).append(x[torch.from_numpy(take)].to(rows_dtype))
    if block_size:
        gram = block_gram(x, block_size)
        a["gram"] = a["gram"] + gram if "gram" in a else gram
    if hessian:
        if "xtx" not in a:
            a["xtx"] = torch.zeros((x.shape[1], x.shape[1]))
        a["xtx"].addmm_(x.T, x)


def collect(graph_path: Path, model: dict, value_names: list[str], windows: list[np.ndarray],
            max_rows: int = 2048, hessian: bool = False, block_size: int = 0) -> dict[str, ActivationStats]:
    """One pass of ``Calibration`` over ``windows`` for the named values (see ``Calibration.collect``)."""
    return Calibration(graph_path, model, windows).collect(value_names, rows=max_rows, block_size=block_size,
                                                           hessian=hessian)
