"""Build for onnxruntime: the step graph after our lowering (ort_lowering.py: fused kernels, unless
``fusion=False``) and onnxruntime's offline optimisations, saved once, every weight stored once; with fusion,
also the decode graph (ort_decode.py, GroupQueryAttention) over the same weights file.

For a quantized export this is also where the backend-specific lowering
happens: onnxruntime's own QDQ fusions turn the portable weight pattern
DequantizeLinear(INT4/INT8) -> MatMul into its MatMulNBits CPU kernel and INT8
Q/DQ pairs into MatMulIntegerToFloat (we checked the numerics against the
unfused graph rather than re-implement the packing). The export artifact keeps
the Q/DQ form TensorRT reads; the manifest records which kernels the engine got.
"""

from __future__ import annotations

import collections
import logging
import shutil
import time
from pathlib import Path

from ..engine_contract import EXACT_MIN_CALL_TOKENS, MATMUL_NBITS_ACCURACY_LEVEL, fuses_qdq
from ..manifest import ENGINE_FORMAT, atomic_artifact, carry_files, export_source, versions
from ..ort_session import session_options

log = logging.getLogger("trtspec.build")
QUANTIZED_KERNELS = ("MatMulNBits", "MatMulIntegerToFloat", "QLinearMatMul", "DequantizeLinear", "QuantizeLinear")


DECODE_GRAPH = "decode.onnx"


def _decode_graph(tmp: Path, graph: str, model: dict,
                  used_for: str = "calls of one row or one token; the others run the built graph") -> dict:
    """decode.onnx beside the built graph (see ort_decode.py), or why there is none."""
    import onnx_ir as ir

    from .ort_decode import NotApplicable, packed_lookup, rewrite

    decode = ir.load(tmp / graph)  # its weights stay references into the built graph's data file
    try:
        layers = rewrite(decode, num_heads=model["num_heads"], num_kv_heads=model["num_kv_heads"])
    except NotApplicable as e:
        log.info("no decode graph: %s", e)
        return {"graph": None, "reason": str(e)}
    lookups = packed_lookup(decode)
    ir.save(decode, tmp / DECODE_GRAPH)
    log.info("decode graph: GroupQueryAttention in %d layers%s", layers,
             ", the INT4 embedding lookup as GatherBlockQuantized" if lookups else "")
    made = {"graph": DECODE_GRAPH, "group_query_attention": layers, "used_for": used_for}
    if lookups:
        made["gather_block_quantized"] = lookups
    return made


def build_onnxruntime(export_dir: Path, export_manifest: dict, out_dir: Path, *, fuse_qdq: bool = True,
                      fusion: bool = True, weights: str | None = None, int8_activations: bool = False) -> Path:
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from .gguf_lowering import gguf_weights
    from .ort_lowering import lower

    t0 = time.perf_counter()
    graph = export_manifest["graph"]
    # fused builds keep their weights in a file of their own, which the decode graph shares
    external = f"{graph}.data" in export_manifest["files"] or fusion
    quantization = export_manifest.get("quantization")
    if weights not in (None, "gguf", "float"):
        raise ValueError(f"weights must be 'gguf' or 'float', got {weights!r}")
    if weights is not None and "gguf" not in export_manifest:
        raise ValueError("--weights applies only to exports of a GGUF file (their own blocks, or float); drop it")
    gguf = "gguf" in export_manifest and weights != "float"
    if int8_activations and not gguf:
        raise ValueError("--int8-activations applies only to a GGUF export's default build (--weights gguf)")
    if int8_activations and export_manifest["model"].get("tree_verify"):
        # measured on SmolLM2: suffix trees reproduced the tree engine's own greedy output on 11 of 20 prompts
        raise ValueError("--int8-activations cannot build an export made with --tree: a tree's nodes attend over "
                         "other cache slots than the same tokens decoded one by one, and int8 activations turn that "
                         "float difference into other tokens, so tree verification would not be lossless; build it "
                         "without --int8-activations, or export without --tree (chains stay exact)")
    if quantization is None and not fuse_qdq:
        raise ValueError("--no-qdq-fusion applies only to quantized exports (made by `trtspec quantize`); drop it")
    fuse = fuse_qdq and fuses_qdq(export_manifest)
    build = {"graph_optimization_level": "extended", "external_data": external, "fusion": fusion}
    if quantization is not None:
        build["fuse_qdq"] = fuse
        if fuse:
            build["matmul_nbits_accuracy_level"] = MATMUL_NBITS_ACCURACY_LEVEL
    manifest = {
        "format": ENGINE_FORMAT,
        "backend": "onnxruntime",
        "graph": graph,
        "tokenizer": export_manifest["tokenizer"],
        "model": export_manifest["model"],
        "build": build,
        "source": export_source(export_dir),
        "versions": versions("onnxruntime", "onnx"),
    }
    if quantization is not None:
        manifest["quantization"] = {k: quantization[k] for k in ("mode", "block_size", "weights", "activations")}
    if "gguf" in export_manifest:
        build["weights"] = "gguf" if gguf else "float"
    with atomic_artifact(out_dir, manifest) as tmp:
        model = ir.load(export_dir / graph)
        if gguf:
            quantization = manifest["quantization"] = gguf_weights(model, export_dir, export_manifest,
                                                                    int8_activations)
        build["rewrites"] = lower(model, fuse_qdq=fuse, fusion=fusion)
        log.info("onnxruntime lowering: %s", ", ".join(f"{k} x{v}" for k, v in build["rewrites"].items()) or "nothing to rewrite")
        data = f"{graph}.data" if external else None
        if quantization is not None and not fuse:
            # Q/DQ run as written: onnxruntime would fold each weight's DequantizeLinear into a float copy (4-8x the
            # bytes). The engine keeps the quantized weights; onnxruntime folds them in memory when it loads.
            build["offline_optimized"] = False
            ir.save(model, tmp / graph, external_data=data)
        else:
            build["offline_optimized"] = True
            staged = tmp / "lowered"
            staged.mkdir()
            ir.save(model, staged / graph, external_data=data)
            del model
            so = session_options(num_threads=None, fuse_qdq=fuse)
            so.optimized_model_filepath = str(tmp / graph)
            if external:
                so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data)
            log.info("optimising %s with onnxruntime %s", export_dir / graph, ort.__version__)
            ort.InferenceSession(str(staged / graph), so, providers=["CPUExecutionProvider"])
            shutil.rmtree(staged)
            if int8_activations:  # one graph for every call, each of 2 tokens or more (engine_contract.py)
                build["min_call_tokens"] = EXACT_MIN_CALL_TOKENS
                log.info("int8 activations: every call runs one graph with %d tokens a row or more, so each row's "
                         "logits are the same in every call", EXACT_MIN_CALL_TOKENS)
                if fusion:  # the graph of sessions of one row a call (engines/onnxruntime.py: plan_rows)
                    build["decode_graph"] = _decode_graph(
                        tmp, graph, export_manifest["model"],
                        used_for="every call of a session planned for one row a call (a Scheduler of max_batch 1); "
                                 "other sessions run the built graph for every call")
            elif fusion:
                build["decode_graph"] = _decode_graph(tmp, graph, export_manifest["model"])
        if quantization is not None:
            ops = collections.Counter(n.op_type for n in onnx.load(str(tmp / graph), load_external_data=False).graph.node)
            build["kernels"] = {op: ops[op] for op in QUANTIZED_KERNELS if ops[op]}
            log.info("quantized kernels in the engine: %s", build["kernels"] or "none")
        carry_files(export_dir, export_manifest, tmp)
    log.info("wrote %s in %.1f s", out_dir, time.perf_counter() - t0)
    return out_dir
