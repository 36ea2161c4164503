"""export/<name>/ -> export/<name>-<mode>/: the same step graph with Q/DQ inserted, and its report."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ArtifactError
from ..exporter.contract import max_call_tokens
from ..manifest import EXPORT_FORMAT, atomic_artifact, export_source, read_manifest, versions
from . import calibrate, numerics, passes
from ..progress import Progress
from .report import Entry, QuantizationReport

log = logging.getLogger("trtspec.quantize")

MODES = {
    # mode: (weight format, activation format or None, calibrated, how inputs are scaled)
    "int8-wo": ("int8", None, False, None),
    "int8-sq": ("int8", "int8", True, "smoothquant"),
    "fp8": ("fp8", "fp8", True, None),
    "int4-rtn": ("int4", None, False, None),
    "int4-awq": ("int4", None, True, "awq"),
    "int4-gptq": ("int4", None, True, "gptq"),
}
BLOCK_SIZES = (32, 64, 128)
DEFAULT_BLOCK_SIZE = 128
DEFAULT_CALIB_SAMPLES = 32
CALIB_SEQ_LEN = 256
SMOOTHQUANT_ALPHA = 0.5
GPTQ_DAMP = 0.01
# AWQ scales a MatMul input only where 1/s folds into the op making it (a norm's weight, up_proj's columns), as
# the reference implementation does under grouped-query attention: elsewhere (o_proj's input, the attention
# output) it would cost a Mul per call. Measured on the retrained target, lm_head in INT4: perplexity +0.780 %
# vs +0.779 % with o_proj scaled (block 32), +1.534 % vs +1.529 % (block 128); the tied 27.8M model's one-token
# call 0.992x the time (`bench_quant.py --out quant-awq-fold`).
AWQ_UNFOLDED_SCALES = False
AWQ_GRID = 20  # alpha in 0, 0.05, ..., 0.95, as the reference implementation
AWQ_ROWS = 512  # calibration rows (tokens) per MatMul input for AWQ's scale search, spread over the windows;
# 2048 measured +0.520 % perplexity vs 512's +0.533 % (block 128), both +0.866 % with the lm_head in blocks of 32 (bench_quant_cost.py)
STATS_MIN_BYTES = 256 << 20
REPORT_FILE = "quantization_report.json"


def quantize(
    export_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    mode: str,
    block_size: int | None = None,
    calib_file: str | os.PathLike | None = None,
    calib_samples: int | None = None,
    quantize_lm_head: bool = False,
    act_order: bool | None = None,
) -> Path:
    """Quantize an export artifact's step graph with ``mode``; returns out_dir.

    Modes: int8-wo (INT8 weights per output channel), int8-sq (W8A8 with
    SmoothQuant), fp8 (FP8 E4M3 weights and activations), int4-rtn, int4-awq and
    int4-gptq (INT4 weights in blocks of ``block_size`` along K; GPTQ visits input
    channels by decreasing activation energy unless ``act_order`` is False). Calibrated
    modes (int8-sq, fp8, int4-awq, int4-gptq) run ``calib_samples`` windows of
    ``calib_file`` (default: the held-out text shipped with trtspec) through the graph.
    ``quantize_lm_head`` also quantizes the lm_head; a head tied to the embedding
    (int4 modes) is quantized once for both uses.
    """
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    block_size, act_order = _checked_options(mode, block_size, calib_file, calib_samples, act_order)
    w_fmt, a_fmt, calibrated, scaling = MODES[mode]
    manifest = _unquantized_export(export_dir, out_dir)

    import onnx_ir as ir

    t0 = time.perf_counter()
    graph_path = export_dir / manifest["graph"]
    model = ir.load(graph_path)
    if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph):
        raise ArtifactError(f"{graph_path} already has QuantizeLinear/DequantizeLinear nodes; quantize an unquantized export")
    report = QuantizationReport(mode)
    linears = passes.find_linears(model, report, include_lm_head=quantize_lm_head)
    if not linears:
        raise ArtifactError(f"{graph_path} has no MatMul with a constant weight to quantize")
    found = passes.find_tied_head(model)
    tied = _tied_head_to_quantize(found, quantize_lm_head, w_fmt, block_size, report) if found is not None else None
    calibration, cal = _calibration(export_dir, manifest, mode, calib_file, calib_samples) if calibrated else (None, None)
    _quantize_layers(model, _units(passes.group_by_activation(linears)), tied, cal, manifest["model"], mode, scaling,
                     block_size, act_order, report)
    if not report.quantized():
        raise ArtifactError(f"no MatMul could be quantized with {mode}:\n{report.format()}")
    model.graph.sort()

    quantization = {
        "mode": mode,
        "block_size": block_size,
        "weights": w_fmt,
        "activations": a_fmt,
        "lm_head": quantize_lm_head,
        "tied_lm_head": found is not None,
        "calibration": calibration,
        # AWQ's search: what decides its scales besides the text (bfloat16 products only where the CPU is fast)
        "search": ({"matmul_dtype": str(numerics.search_dtype()).removeprefix("torch."), "rows": AWQ_ROWS,
                    "grid": AWQ_GRID} if scaling == "awq" else None),
        "report": REPORT_FILE,
        "summary": report.summary(),
        "source": export_source(export_dir),
    }
    out = {**manifest, "quantization": quantization, "versions": {**manifest["versions"], **versions("onnx_ir")}}
    out.pop("files", None)
    with atomic_artifact(out_dir, out) as tmp:
        weight_bytes = _save(model, tmp / manifest["graph"], manifest["model"])
        del model
        out["model"] = {**manifest["model"], "weight_bytes": weight_bytes}
        (tmp / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        shutil.copytree(export_dir / manifest["tokenizer"], tmp / manifest["tokenizer"])
    log.info("%s", report.format())
    log.info("wrote %s in %.1f s", out_dir, time.perf_counter() - t0)
    return out_dir


def _checked_options(mode: str, block_size, calib_file, calib_samples, act_order) -> tuple[int | None, bool]:
    """quantize()'s options checked against its mode: (the block size, None outside the int4 modes; act_order)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(MODES)}")
    w_fmt, _, calibrated, scaling = MODES[mode]
    if w_fmt == "int4":
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"block size {block_size} is not supported; choose one of {', '.join(map(str, BLOCK_SIZES))}")
    elif block_size is not None:
        raise ValueError(f"--block-size applies only to the int4 modes, not {mode}; drop it")
    if not calibrated and (calib_file is not None or calib_samples is not None):
        raise ValueError(f"{mode} does not calibrate; drop --calib-file/--calib-samples "
                         "(they apply to int8-sq, fp8, int4-awq, int4-gptq)")
    if act_order is not None and scaling != "gptq":
        raise ValueError(f"act_order (--no-act-order) applies only to int4-gptq, not {mode}; drop it")
    if calib_samples is not None and calib_samples < 1:
        raise ValueError(f"calib_samples must be at least 1 (got {calib_samples})")
    return block_size, True if act_order is None else act_order


def _unquantized_export(export_dir: Path, out_dir: Path) -> dict:
    """The manifest of ``export_dir``, an export not yet quantized and not ``out_dir`` itself."""
    manifest = read_manifest(export_dir)
    if manifest["format"] != EXPORT_FORMAT:
        raise ArtifactError(f"{export_dir} is a built engine, not an export; quantize the export/ directory it was built from")
    if "quantization" in manifest:
        raise ArtifactError(
            f"{export_dir} is already quantized ({manifest['quantization']['mode']}); quantize the unquantized export "
            f"it came from ({manifest['quantization']['source']['export_dir']})"
        )
    if out_dir.resolve() == export_dir.resolve():
        raise ValueError("the output directory is the export itself; write the quantized artifact elsewhere (-o)")
    return manifest


def _tied_head_to_quantize(tied: passes.TiedHead, quantize_lm_head: bool, w_fmt: str, block_size: int | None,
                           report: QuantizationReport) -> passes.TiedHead | None:
    """The lm_head tied to the embedding, where it is quantized (once for both uses); else None, and the report
    says why it is left in high precision."""
    shape = tuple(tied.weight_array().shape)
    if not quantize_lm_head:
        why = "tied to the embedding; left in high precision (pass --quantize-lm-head to quantize both uses in INT4)"
    elif w_fmt != "int4":
        why = "tied to the embedding; a tied lm_head is quantized in the int4 modes only"
    elif tied.embedding.shape[1] % block_size:
        why = (f"tied to the embedding; block size {block_size} does not divide the hidden size "
               f"{tied.embedding.shape[1]}")
    else:
        return tied
    report.entries.append(Entry(tied.name, shape, "skipped", why, 0, 0))
    return None


def _calibration(export_dir: Path, manifest: dict, mode: str, calib_file, calib_samples):
    """(the manifest's calibration section, a Calibration over the windows of the calibration text)."""
    from transformers import AutoTokenizer

    texts, calibration = calibrate.load_texts(calib_file)
    tokenizer = AutoTokenizer.from_pretrained(export_dir / manifest["tokenizer"])
    # one call per window: at most the tokens a call may carry (fewer where sliding-window layers keep rings)
    seq_len = min(CALIB_SEQ_LEN, max_call_tokens(manifest["model"]))
    windows = calibrate.token_windows(texts, tokenizer, calib_samples or DEFAULT_CALIB_SAMPLES, seq_len)
    calibration.update(samples=len(windows), tokens=int(sum(map(len, windows))), seq_len=seq_len,
                       tokens_sha256=calibrate.windows_sha256(windows))
    log.info("calibrating %s on %d windows of up to %d tokens", mode, len(windows), seq_len)
    return calibration, calibrate.Calibration(export_dir / manifest["graph"], manifest["model"], windows)


def _quantize_layers(model, units, tied, cal, model_config: dict, mode: str, scaling, block_size, act_order,
                     report: QuantizationReport) -> None:
    """Each unit's layers (and the tied head) quantized in place, in as few calibration passes as the statistics'
    memory budget allows (one pass over the windows collects the statistics of a part of the units)."""
    wanted = _stats_wanted(scaling, block_size)
    work = [*units, *([[[tied]]] if tied is not None else [])]  # the tied head: a unit of one group of itself
    plan = _calibration_passes(work, cal, wanted, _stats_budget(model_config)) if cal else [work]
    progress = Progress(f"quantize {mode}", len(work), "layer", log)
    for p, part in enumerate(plan):
        stats = {}
        if cal is not None:
            names = list(dict.fromkeys(g[0].activation.name for unit in part for g in unit))
            progress.pause()
            stats = cal.collect(names, **wanted, what=f"pass {p + 1}/{len(plan)}" if len(plan) > 1 else "")
            progress.resume()
        for unit in part:
            if isinstance(unit[0][0], passes.TiedHead):
                _quantize_tied(model, tied, scaling, stats, block_size, act_order, report)
            else:
                _quantize_unit(model, unit, stats, mode, block_size, act_order, report)
            progress.update(progress.done + 1, unit[0][0].name)
        del stats
    progress.close()


def _gptq_detail(act_order: bool) -> str:
    return f"GPTQ (damp {GPTQ_DAMP}, {'activation order' if act_order else 'channel order'})"


def _layer_of(name: str) -> int | None:
    """The layer index in a MatMul's name (layers.3.mlp.up_proj, h.3.attn.c_attn): its first number."""
    m = re.search(r"(?:^|[._/])(\d+)(?=[._/]|$)", name)
    return int(m.group(1)) if m else None


def _units(groups: list[list[passes.Linear]]) -> list[list[list[passes.Linear]]]:
    """The groups by layer, in graph order: a layer's AWQ scales all fold before any of its weights is rounded
    (down_proj's 1/s folds into up_proj's columns). A group whose name has no layer number is a unit alone."""
    units, index = [], {}
    for group in groups:
        layer = _layer_of(group[0].name)
        if layer is None:
            units.append([group])
            continue
        if layer not in index:
            index[layer] = len(units)
            units.append([])
        units[index[layer]].append(group)
    return units


def _stats_wanted(scaling: str | None, block_size: int | None) -> dict:
    """What calibration must record per MatMul input: AWQ rows for its scale search and each block's Gram matrix
    for its clipping; GPTQ the Hessian; SmoothQuant and FP8 only |x| maxima."""
    if scaling == "awq":  # rows in the search's matmul dtype: bfloat16 halves them where that is the fast one
        return {"rows": AWQ_ROWS, "block_size": block_size, "rows_dtype": numerics.search_dtype()}
    return {"hessian": scaling == "gptq"}


def _stats_budget(model: dict) -> int:
    """Bytes of calibration statistics one pass may hold: half the weights (onnxruntime holds the weights while
    a pass runs, so a pass peaks near 1.5x them), at least 256 MiB."""
    return max(STATS_MIN_BYTES, model["weight_bytes"] // 2)


def _calibration_passes(work: list, cal, wanted: dict, budget: int) -> list[list]:
    """``work`` (units of groups) cut into consecutive runs whose statistics fit ``budget``: one calibration pass
    each (a pass stops onnxruntime at its last layer, so k passes cost less than k full forwards)."""
    plan, size = [[]], 0
    for unit in work:
        need = sum(cal.stats_bytes(_k(g[0]), **wanted) for g in unit)
        if plan[-1] and size + need > budget:
            plan.append([])
            size = 0
        plan[-1].append(unit)
        size += need
    if len(plan) > 1:
        log.info("calibration statistics need %d passes (%.0f MiB per pass at most)", len(plan), budget / 2**20)
    return plan


def _k(linear) -> int:
    """K of a MatMul's [K, N] weight (a tied head: the embedding's width), from the shape alone."""
    if isinstance(linear, passes.TiedHead):
        return linear.embedding.shape[1]
    return linear.weight.const_value.shape[0]


def _quantize_unit(model, unit, stats, mode: str, block_size, act_order, report) -> None:
    """One layer: input scaling (SmoothQuant, AWQ) of all its groups, then AWQ clipping or GPTQ, then its
    weights (and FP8/INT8 activations) in Q/DQ. The weights it replaced are released from memory."""
    w_fmt, a_fmt, _, scaling = MODES[mode]
    clips, precomputed, scales = {}, {}, {}
    seen = [stats.get(group[0].activation.name) for group in unit]  # before scaling changes the inputs' names
    for group, x in zip(unit, seen):
        if scaling == "smoothquant":
            scales[id(group[0])] = numerics.smoothquant_factors(x.absmax, [lin.weight_array() for lin in group],
                                                                SMOOTHQUANT_ALPHA)
            passes.scale_inputs(model, group, scales[id(group[0])], report, f"SmoothQuant (alpha {SMOOTHQUANT_ALPHA})")
        elif scaling == "awq":
            scales[id(group[0])] = _awq_scale(model, group, x, block_size, report)
    for group, x in zip(unit, seen):
        if scaling == "awq":
            _awq_clip(group, x, scales[id(group[0])], block_size, report, clips)
        elif scaling == "gptq":
            weights = [lin.weight_array() for lin in group]
            q, scale = numerics.gptq(np.concatenate(weights, axis=1), x.xtx, block_size, damp=GPTQ_DAMP,
                                     act_order=act_order)  # output channels are independent: one run per input
            edges = np.cumsum([0] + [w.shape[1] for w in weights])
            for lin, a, b in zip(group, edges[:-1], edges[1:]):
                precomputed[lin.name] = (q[:, a:b], scale[:, a:b])
                report.update(lin.name, detail=_gptq_detail(act_order))
    passes.quantize_weights(model, [lin for group in unit for lin in group], w_fmt, report, block_size or 0, clips,
                            precomputed)
    if a_fmt is not None:
        for group, x in zip(unit, seen):
            s = scales.get(id(group[0]))  # SmoothQuant's (AWQ is weight-only)
            passes.quantize_activations(model, group, float(np.max(x.absmax / (s if s is not None else 1.0))),
                                        a_fmt, report)


def _quantize_tied(model, tied, scaling, stats, block_size, act_order, report):
    """The tied embedding/lm_head weight in INT4, quantized as the head's [H, V] weight, once for both uses."""
    w = tied.weight_array()
    if scaling == "gptq":
        q, scale = numerics.gptq(w, stats[tied.activation.name].xtx, block_size, damp=GPTQ_DAMP,
                                 act_order=act_order)
        detail = _gptq_detail(act_order)
    elif scaling == "awq":  # AWQ's input scaling would change the embedding too: clipping only
        clip, _, _ = numerics.awq_clip_search(stats[tied.activation.name].block_gram, w, block_size)
        q, scale = numerics.int4_blocked(w, block_size, clip)
        detail = f"AWQ clipping (no input scaling: the weight is shared), {float(np.mean(clip < 1.0)):.0%} of blocks clipped"
    else:
        q, scale = numerics.int4_blocked(w, block_size)
        detail = "round to nearest"
    passes.quantize_tied_head(model, tied, q, scale, block_size, report, detail)
    log.debug("tied embedding/lm_head quantized to int4 (%s)", detail)


@dataclass
class _AwqScale:
    s: np.ndarray | None  # None: s = 1 was best (or the scale does not fold)
    alpha: float
    rtn_loss: float  # round-to-nearest's output error on the calibration rows
    originals: list[np.ndarray]  # the group's weights before scaling


def _awq_scale(model, group, stats, block_size: int, report: QuantizationReport) -> _AwqScale:
    """AWQ's input scale search for one group, applied (x / s, diag(s) W)."""
    weights = [lin.weight_array() for lin in group]
    foldable = AWQ_UNFOLDED_SCALES or passes.input_scale_foldable(model, group)
    s, alpha, _, rtn_loss = numerics.awq_search(stats.rows, stats.mean_abs, weights, block_size,
                                                grid=AWQ_GRID if foldable else 1, matmul_dtype=numerics.search_dtype())
    if not foldable:
        report.notes.append(f"AWQ scale skipped on the input of {', '.join(lin.name for lin in group)}: 1/s would "
                            "not fold into the op making it (a Mul per call); clipping only")
    if alpha > 0.0:
        passes.scale_inputs(model, group, s, report, f"AWQ scale (alpha {alpha:.2f})")
    return _AwqScale(s if alpha > 0.0 else None, alpha, rtn_loss, [np.array(w, np.float32) for w in weights])


def _awq_clip(group, stats, found: _AwqScale, block_size: int, report: QuantizationReport, clips: dict) -> None:
    """AWQ's clipping search for each (scaled) weight of the group, into ``clips``; notes the group's
    calibration output error against round-to-nearest's."""
    import torch

    dtype = numerics.search_dtype()
    x = stats.rows.to(dtype)
    s = found.s
    inv = torch.from_numpy(1.0 / s if s is not None else np.ones(stats.rows.shape[1], np.float32))[:, None]
    loss = 0.0
    for lin, original in zip(group, found.originals):
        scaled = lin.weight_array()
        clips[lin.name], _, _ = numerics.awq_clip_search(stats.block_gram, scaled, block_size, s=s)
        deq = torch.from_numpy(numerics.fake_quantize(scaled, "int4", block_size, clips[lin.name]))
        loss += float(torch.square((x @ (torch.from_numpy(original) - deq * inv).to(dtype)).float()).sum())
        clipped = float(np.mean(clips[lin.name] < 1.0))
        report.update(lin.name, detail=f"AWQ alpha {found.alpha:.2f}, {clipped:.0%} of blocks clipped")
    report.notes.append(f"AWQ on the input of {', '.join(lin.name for lin in group)}: calibration output error "
                        f"{loss / max(found.rtn_loss, 1e-30):.3f} of round-to-nearest's")


def _save(model, path: Path, model_section: dict) -> int:
    """Write the graph, check it (ONNX, step contract, TensorRT's Q/DQ rules); returns its initializer bytes."""
    import onnx
    import onnx_ir as ir

    from ..exporter.contract import check_step_graph, contract_options
    from ..exporter.step_graph import EXTERNAL_DATA_BYTES
    from .rules import qdq_violations

    external = model_section["weight_bytes"] > EXTERNAL_DATA_BYTES
    ir.save(model, path, external_data=f"{path.name}.data" if external else None)
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path), load_external_data=False)
    check_step_graph(proto, model_section["num_layers"], **contract_options(model_section))
    problems = qdq_violations(proto, path.parent)
    assert not problems, "quantization produced a graph TensorRT would refuse:\n" + "\n".join(problems)
    total = 0
    for init in proto.graph.initializer:
        stored = {e.key: e.value for e in init.external_data}
        total += int(stored["length"]) if "length" in stored else len(init.raw_data)
    return total
