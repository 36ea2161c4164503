"""What an engine artifact promises whoever loads it, shared by the builder (which writes it) and the engines (which
run it), so neither imports the other for it: the onnxruntime settings a build bakes into its graph (MatMulNBits'
accuracy level, whether Q/DQ nodes may fuse) and which profile of a TensorRT plan runs a call (the runtime picks one
per call; the builder writes the plan, builder/tensorrt_plan.py)."""

from __future__ import annotations

from .errors import CapacityError

MATMUL_NBITS_ACCURACY_LEVEL = 4

# Engines whose rows must be computed the same way in every call: an int8-activation build (`build
# --int8-activations`) runs every call with at least this many tokens a row, on one graph. onnxruntime's CPU GEMM
# (MLAS) takes a kernel of its own for a one-row product (M = 1), which sums in another order; its 1e-7 differences
# then flip an int8 rounding of the activations and grow to logit differences of 1-2 over SmolLM2's 30 layers. From
# 2 tokens up, each row's logits were bit-identical whatever the call's rows, tokens and live length: a decode call
# carries one pad token (the last token again, one position on, its cache write hidden by the mask and overwritten
# by the next), so speculation reproduces the engine's own greedy output exactly, at any batch size. The one graph
# is the session's: the GroupQueryAttention decode graph (bit-identical only to itself, across tokens and chunking)
# for a session of one row a call, the built graph for any other (engines/onnxruntime.py: plan_rows).
EXACT_MIN_CALL_TOKENS = 2


def fuses_qdq(manifest: dict) -> bool:
    """Whether onnxruntime may fuse this artifact's Q/DQ nodes: for weight-only quantization only.

    With quantized activations the fusion does not pay here: onnxruntime 1.31 fuses FP8
    Q/DQ around a MatMul into MatMulIntegerToFloat, which takes only 8-bit integers, and
    then refuses its own graph; for INT8 W8A8 (int8-sq) it fuses a third of the MatMuls and
    the decode call became 5x slower than the unfused graph (24 vs 4-5 ms on the bundled target).
    """
    if (manifest.get("quantization") or {}).get("activations") is not None:
        return False
    return manifest.get("build", {}).get("fuse_qdq", True)


def select_profile(plan: dict, batch: int, tokens: int) -> int:
    """The index of the profile (= execution context) that runs a [batch, tokens] call."""
    if batch > plan["max_batch"]:
        raise CapacityError(
            f"batch of {batch} rows but the engine was built for {plan['max_batch']}; rebuild with a larger export --max-batch"
        )
    for index, profile in enumerate(plan["profiles"]):
        if profile["tokens"] == tokens:
            return index
    if tokens <= plan["max_prefill"]:
        return 0
    raise CapacityError(
        f"a call of {tokens} tokens per row exceeds the engine's prefill profile ({plan['max_prefill']} tokens) "
        f"and matches no verify profile {plan['verify_tokens']}; rebuild with --max-prefill {tokens}"
    )


def is_static(profile: dict) -> bool:
    """Decode and verify profiles have one T, so a CUDA graph per batch size replays them."""
    return profile["tokens"] is not None
