"""The onnxruntime session settings every session of ours uses: the engine's, the builder's (which optimises the
graph with them and saves the result), and calibration's. A bottom-layer module, so that none of those imports
another stage for it."""

from __future__ import annotations

from .engine_contract import MATMUL_NBITS_ACCURACY_LEVEL


def session_options(num_threads: int | None, *, fuse_qdq: bool = True):
    """Our onnxruntime session settings.

    ``fuse_qdq`` lets onnxruntime replace Q/DQ patterns by its quantized CPU kernels:
    an INT4/INT8 weight DequantizeLinear -> MatMul becomes MatMulNBits (here with
    accuracy_level 4: int8 dot products), INT8 Q/DQ pairs MatMulIntegerToFloat.
    Without it the graph computes exactly what its Q/DQ nodes say: onnxruntime dequantizes
    constant weights once, when it optimises the graph, and runs activation Q/DQ as written.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1 (got {num_threads})")
        so.intra_op_num_threads = num_threads
    # Worker threads spin between the nodes of a run and stop when it ends (benchmarks/bench_spinning.py on the
    # bundled pair: target decode call 3.48 ms vs 4.27 without spinning, INT4 0.71 vs 1.62 ms; speculation at
    # k = 4 446 vs 483 tok/s, while plain spinning, never stopped, fell to 205: a target and a draft session
    # alternate, and one session's spinning threads take the cores from the other).
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    if fuse_qdq:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(MATMUL_NBITS_ACCURACY_LEVEL))
    else:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    so.log_severity_level = 3
    return so
