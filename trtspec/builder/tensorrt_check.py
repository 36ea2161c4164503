"""Static TensorRT-compatibility check of a step graph, on CPU with the onnx package.

It reports what TensorRT's ONNX parser is documented to refuse or to import
differently than we need, one line per problem, naming the node. Sources:
the operator support matrix of onnx-tensorrt (``docs/operators.md``, TensorRT
10.15, opset 9..24), TensorRT's KVCacheUpdate operator page, and the
TensorRT 11 migration guide (strong typing; explicit, symmetric Q/DQ only).
The step-graph contract itself is checked by ``exporter.contract``.
"""

from __future__ import annotations

import os
from pathlib import Path

from onnx import TensorProto

from ..errors import ArtifactError
from ..exporter.contract import contract_options, contract_violations
from ..manifest import EXPORT_FORMAT, read_manifest
from ..onnx_graph import GraphIndex, attr, dims
from ..quantization.rules import qdq_node_violations

# Operators the parser supports ("Y" rows of the support matrix, default ONNX domain).
SUPPORTED_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization BlackmanWindow
Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv
DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If ImageScaler
InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM
LpNormalization LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression
NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin
ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN RoiAlign
RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin
Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TensorScatter
ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# The cache dtypes of TensorRT's KVCacheUpdate layer (what TensorScatter imports as).
CACHE_DTYPES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
# -- rules: each takes (node, graph, model section) and yields problem strings -------------------


def _check_op_supported(node, g, model):
    if node.domain not in ("", "ai.onnx"):
        yield f"{node.name}: {node.domain}.{node.op_type} is a custom-domain op; TensorRT's ONNX parser imports only standard ONNX ops (or plugins)"
    elif node.op_type not in SUPPORTED_OPS:
        yield f"{node.name}: {node.op_type} is not supported by TensorRT's ONNX parser"


def _check_tensor_scatter(node, g, model):
    if node.op_type != "TensorScatter":
        return
    cache = node.input[0]
    if cache not in g.inputs:
        yield (
            f"{node.name}: TensorScatter's cache input {cache!r} comes from {g.describe(cache)}, not straight from a "
            "graph input; TensorRT imports the in-place KV cache update only when the cache graph input feeds it "
            "directly (no Cast/Reshape between)"
        )
    else:
        rank = len(dims(g.tensor_type(cache)) or [])
        if rank != 4:
            yield f"{node.name}: TensorScatter's cache {cache!r} has rank {rank}; TensorRT needs a 4-D [B, Hkv, S_max, D] cache"
    if node.output[0] not in g.outputs:
        yield f"{node.name}: TensorScatter's result {node.output[0]!r} is not a graph output; TensorRT's in-place update needs it to be one"
    axis = attr(node, "axis", -2)
    if axis != -2:
        yield f"{node.name}: TensorScatter axis is {axis}; TensorRT requires axis=-2 written literally"
    mode = attr(node, "mode", b"linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "linear":
        yield (f"{node.name}: TensorScatter mode {mode!r}; TensorRT's KV cache update supports only 'linear' (a "
               "sliding-window layer's ring buffer: re-export with --no-ring-cache for TensorRT)")


def _check_attention(node, g, model):
    # past_key/past_value/nonpad_kv_seqlen inputs and present_* outputs are the contract's checks.
    if node.op_type != "Attention":
        return
    if attr(node, "softcap", 0.0):
        yield f"{node.name}: Attention softcap={attr(node, 'softcap')}; TensorRT does not support softcap"
    if attr(node, "qk_matmul_output_mode", 0):
        yield f"{node.name}: Attention qk_matmul_output_mode is set; TensorRT does not support it"
    if len(node.input) < 4 or not node.input[3]:
        return
    mask = node.input[3]
    mask_type = g.tensor_type(mask)
    if mask_type is not None and mask_type.elem_type != TensorProto.BOOL:
        yield f"{node.name}: Attention mask {mask!r} is not bool; the step graph's mask is a bool [B, 1, T, S_max] tensor"
    shape = dims(mask_type)
    slots = sorted(set(model.get("cache_slots") or [model["max_seq_len"]]))  # S_max, or a sliding-window ring
    if shape is None or len(shape) != 4 or shape[1] != 1 or shape[3] not in slots:
        yield (
            f"{node.name}: Attention mask {mask!r} has shape {shape}; expected [B, 1, T, "
            f"{' or '.join(map(str, slots))}] (4-D, one head, all cache slots)"
        )


def _check_qdq(node, g, model):
    yield from qdq_node_violations(node, g)


NODE_RULES = (_check_op_supported, _check_tensor_scatter, _check_attention, _check_qdq)


def _check_cache_dtypes(g, model):
    for past in model["kv_aliases"].values():
        tt = g.tensor_type(past)
        if tt is None:
            continue
        if tt.elem_type not in CACHE_DTYPES:
            name = TensorProto.DataType.Name(tt.elem_type)
            yield (
                f"{past}: KV cache dtype {name}; TensorRT's KV cache update takes {', '.join(CACHE_DTYPES.values())} "
                "(an INT8/FP8 KV cache is not supported); keep the cache in float16 or bfloat16"
            )


def tensorrt_violations(model_proto, model: dict, base_dir=None) -> list[str]:
    """Every documented reason TensorRT would refuse or mis-import this step graph, one line each, naming the node.

    ``base_dir``: the graph file's directory, for a model loaded without its external data."""
    problems = [f"contract: {p}" for p in contract_violations(model_proto, model["num_layers"], **contract_options(model))]
    g = GraphIndex(model_proto, base_dir)
    problems += _check_cache_dtypes(g, model)
    for node in model_proto.graph.node:
        for rule in NODE_RULES:
            problems += rule(node, g, model)
    return problems


def check_export(export_dir: str | os.PathLike) -> list[str]:
    """Run the TensorRT check on an export artifact's step graph; returns the violations (empty: compatible)."""
    import onnx

    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    if manifest["format"] != EXPORT_FORMAT:
        raise ArtifactError(f"{export_dir} is a built engine, not an export; pass the export/ directory it came from")
    model_proto = onnx.load(str(export_dir / manifest["graph"]), load_external_data=False)
    return tensorrt_violations(model_proto, manifest["model"], (export_dir / manifest["graph"]).parent)


def format_report(export_dir, problems: list[str]) -> str:
    if not problems:
        return f"{export_dir}: no TensorRT incompatibilities found"
    lines = [f"{export_dir}: {len(problems)} TensorRT incompatibilit{'y' if len(problems) == 1 else 'ies'}:"]
    return "\n  ".join([*lines, *problems])
