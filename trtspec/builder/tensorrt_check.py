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

from onnx import TensorProto, helper, numpy_helper

from ..errors import ArtifactError
from ..exporter.contract import contract_violations
from ..manifest import EXPORT_FORMAT, read_manifest

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
INT4_TYPES = {TensorProto.INT4, TensorProto.UINT4}


class _Graph:
    """Indexes of one graph: producers, initializers, constants, value types."""

    def __init__(self, model):
        graph = model.graph
        self.graph = graph
        self.inputs = {i.name: i for i in graph.input}
        self.outputs = {o.name for o in graph.output}
        self.initializers = {i.name: i for i in graph.initializer}
        self.producer = {out: node for node in graph.node for out in node.output}
        self.constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
        self.types = {v.name: v.type for v in [*graph.value_info, *graph.input, *graph.output]}
        self._model = model
        self._inferred = False

    def tensor_type(self, name: str):
        if name not in self.types and not self._inferred:
            # Shape inference needs no weights: it runs on a model loaded without external data.
            import onnx

            inferred = onnx.shape_inference.infer_shapes(self._model)
            self.types.update({v.name: v.type for v in inferred.graph.value_info})
            self._inferred = True
        return self.types[name].tensor_type if name in self.types else None

    def constant(self, name: str):
        """The TensorProto of a constant initializer or Constant node output; None when computed at run time."""
        if name in self.initializers:
            return self.initializers[name]
        node = self.constants.get(name)
        if node is not None:
            return next((a.t for a in node.attribute if a.name == "value"), None)
        return None

    def describe(self, name: str) -> str:
        node = self.producer.get(name)
        return f"{node.op_type} node {node.name!r}" if node is not None else "no node (a computed value)"


def _dims(tensor_type) -> list | None:
    if tensor_type is None or not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim]


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


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
        rank = len(_dims(g.tensor_type(cache)) or [])
        if rank != 4:
            yield f"{node.name}: TensorScatter's cache {cache!r} has rank {rank}; TensorRT needs a 4-D [B, Hkv, S_max, D] cache"
    if node.output[0] not in g.outputs:
        yield f"{node.name}: TensorScatter's result {node.output[0]!r} is not a graph output; TensorRT's in-place update needs it to be one"
    axis = _attr(node, "axis", -2)
    if axis != -2:
        yield f"{node.name}: TensorScatter axis is {axis}; TensorRT requires axis=-2 written literally"
    mode = _attr(node, "mode", b"linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "linear":
        yield f"{node.name}: TensorScatter mode {mode!r}; TensorRT's KV cache update supports only 'linear'"


def _check_attention(node, g, model):
    # past_key/past_value/nonpad_kv_seqlen inputs and present_* outputs are the contract's checks.
    if node.op_type != "Attention":
        return
    if _attr(node, "softcap", 0.0):
        yield f"{node.name}: Attention softcap={_attr(node, 'softcap')}; TensorRT does not support softcap"
    if _attr(node, "qk_matmul_output_mode", 0):
        yield f"{node.name}: Attention qk_matmul_output_mode is set; TensorRT does not support it"
    if len(node.input) < 4 or not node.input[3]:
        return
    mask = node.input[3]
    mask_type = g.tensor_type(mask)
    if mask_type is not None and mask_type.elem_type != TensorProto.BOOL:
        yield f"{node.name}: Attention mask {mask!r} is not bool; the step graph's mask is a bool [B, 1, T, S_max] tensor"
    dims = _dims(mask_type)
    if dims is None or len(dims) != 4 or dims[1] != 1 or dims[3] != model["max_seq_len"]:
        yield (
            f"{node.name}: Attention mask {mask!r} has shape {dims}; expected [B, 1, T, {model['max_seq_len']}] "
            "(4-D, one head, all cache slots)"
        )


def _check_qdq(node, g, model):
    if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
        return
    scale = node.input[1]
    if g.constant(scale) is None:
        yield f"{node.name}: {node.op_type} scale {scale!r} comes from {g.describe(scale)}; TensorRT needs constant scales (an initializer)"
    if len(node.input) > 2 and node.input[2]:
        yield from _check_zero_point(node, g)
    quantized = _quantized_type(node, g)
    if quantized == TensorProto.UINT8:
        yield f"{node.name}: {node.op_type} uses UINT8; TensorRT quantizes to INT8 (UINT8 is only a network I/O type)"
    if quantized in INT4_TYPES:
        yield from _check_int4(node, g)


def _check_zero_point(node, g):
    zp = g.constant(node.input[2])
    if zp is None:
        yield f"{node.name}: {node.op_type} zero point {node.input[2]!r} is computed at run time; TensorRT needs none or a constant 0"
    elif numpy_helper.to_array(zp).astype("float64").any():
        yield f"{node.name}: {node.op_type} has a nonzero zero point (asymmetric quantization); TensorRT supports only symmetric Q/DQ (zero point 0)"


def _quantized_type(node, g) -> int | None:
    """The integer/float8 type on the quantized side of a Q or DQ node."""
    if len(node.input) > 2 and node.input[2]:
        zp = g.constant(node.input[2])
        if zp is not None:
            return zp.data_type
    if node.op_type == "QuantizeLinear":
        return _attr(node, "output_dtype", 0) or None
    source = g.constant(node.input[0])
    if source is not None:
        return source.data_type
    tt = g.tensor_type(node.input[0])
    return tt.elem_type if tt is not None else None


def _check_int4(node, g):
    if node.op_type == "QuantizeLinear":
        yield f"{node.name}: INT4 QuantizeLinear; TensorRT takes INT4 only as weight-only DequantizeLinear of constant weights"
        return
    weight = g.constant(node.input[0])
    if weight is None:
        yield f"{node.name}: INT4 DequantizeLinear of {node.input[0]!r}, which is not a constant weight; INT4 is weight-only in TensorRT"
        return
    if len(weight.dims) != 2:
        yield f"{node.name}: INT4 weight {node.input[0]!r} is {len(weight.dims)}-D; TensorRT's INT4 DequantizeLinear takes 2-D weights"
    if not _attr(node, "block_size", 0):
        yield f"{node.name}: INT4 DequantizeLinear without block_size; TensorRT's INT4 is blocked (block_size along K)"


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


def tensorrt_violations(model_proto, model: dict) -> list[str]:
    """Every documented reason TensorRT would refuse or mis-import this step graph, one line each, naming the node."""
    problems = [f"contract: {p}" for p in contract_violations(model_proto, model["num_layers"])]
    g = _Graph(model_proto)
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
    return tensorrt_violations(model_proto, manifest["model"])


def format_report(export_dir, problems: list[str]) -> str:
    if not problems:
        return f"{export_dir}: no TensorRT incompatibilities found"
    lines = [f"{export_dir}: {len(problems)} TensorRT incompatibilit{'y' if len(problems) == 1 else 'ies'}:"]
    return "\n  ".join([*lines, *problems])
