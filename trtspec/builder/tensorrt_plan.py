"""The TensorRT profile plan: which shapes the engine is built for, and what the runtime must allocate.

Pure Python on the export manifest, so it is computed and checked before
TensorRT is imported, stored in the engine manifest, and read back by the
engine at load time (DESIGN.md §3):

- profile 0, ``prefill``: T in 1..max_prefill (any call that is not decode or verify);
- profile 1, ``decode``: T = 1;
- one ``verify_{T}`` profile per T in verify_tokens (T = k + 1 for k drafted tokens).

Every profile takes B in 1..max_batch. Decode and verify profiles have a
static T, so the engine can capture one CUDA graph per (profile, B).
"""

from __future__ import annotations


# The KV cache dtypes TensorRT's KVCacheUpdate layer takes (the TensorScatter import); bytes per element.
CACHE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Default verify sizes: k = 1..8 drafted tokens, so --k-policy load-aware has room to choose.
DEFAULT_VERIFY_TOKENS = tuple(range(2, 10))


def _check_int(name: str, value, low: int, high: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} is {value} but must lie in {low}..{high}; {fix}")
    return value


def _check_verify_tokens(verify_tokens, max_seq_len: int) -> list[int]:
    values = sorted(set(verify_tokens))
    for t in values:
        _check_int(
            "each verify_tokens value",
            t,
            2,
            max_seq_len,
            "a value is the tokens of one verify call, k + 1 for k drafted tokens (T = 1 is the decode profile), "
            f"and at most the KV cache capacity {max_seq_len}",
        )
    return values


def _shapes(model: dict, b_max: int, t_min: int, t_opt: int, t_max: int) -> dict:
    # input_ids/position_ids [B, T]; past_* [B, Hkv, S_max, D]. B runs 1..max_batch in every profile.
    # opt = max: the runtime fills batches up to max_batch, and kernels chosen for the largest shape serve smaller ones.
    tokens = {"min": [1, t_min], "opt": [b_max, t_opt], "max": [b_max, t_max]}
    cache_tail = [model["num_kv_heads"], model["max_seq_len"], model["head_dim"]]
    cache = {"min": [1, *cache_tail], "opt": [b_max, *cache_tail], "max": [b_max, *cache_tail]}
    past = [name for name in model["kv_aliases"].values()]
    shapes = {"input_ids": tokens, "position_ids": tokens}
    if model.get("tree_verify"):  # [B, T, T]: a static-T verify profile serves trees of T - 1 nodes
        shapes["tree_mask"] = {key: [b, t, t] for key, (b, t) in tokens.items()}
    return {**shapes, **{name: cache for name in past}}


def profile_plan(model: dict, *, max_prefill: int | None = None, verify_tokens=DEFAULT_VERIFY_TOKENS,
                 max_batch: int | None = None) -> dict:
    """The optimisation profiles and runtime buffers for an export manifest's ``model`` section.

    ``max_prefill`` defaults to the KV cache capacity (every prompt that fits
    the cache fits a call), ``max_batch`` to the export's. Raises ValueError
    saying what to change when an option cannot be served.
    """
    s_max, export_batch = model["max_seq_len"], model["max_batch"]
    if min(model.get("cache_slots") or [s_max]) < s_max:
        raise ValueError(
            "the export keeps ring-buffer caches for its sliding-window layers (TensorScatter mode='circular'), and "
            "TensorRT's KV cache update (IKVCacheUpdateLayer) has only the linear mode; re-export with "
            "--no-ring-cache for TensorRT"
        )
    max_batch = export_batch if max_batch is None else _check_int(
        "max_batch", max_batch, 1, export_batch, f"the export holds {export_batch} rows; re-export with --max-batch {max_batch}"
    )
    max_prefill = s_max if max_prefill is None else _check_int(
        "max_prefill", max_prefill, 1, s_max, f"a prefill call cannot write more than the KV cache's {s_max} positions"
    )
    verify = _check_verify_tokens(verify_tokens, s_max)
    dtype = model["dtype"]
    if dtype not in CACHE_DTYPE_BYTES:
        raise ValueError(
            f"the export's KV cache dtype is {dtype}; TensorRT's KV cache update takes {', '.join(CACHE_DTYPE_BYTES)}. "
            "Re-export with --dtype float16"
        )
    profiles = [
        {"name": "prefill", "tokens": None, "shapes": _shapes(model, max_batch, 1, max_prefill, max_prefill)},
        {"name": "decode", "tokens": 1, "shapes": _shapes(model, max_batch, 1, 1, 1)},
        *({"name": f"verify_{t}", "tokens": t, "shapes": _shapes(model, max_batch, t, t, t)} for t in verify),
    ]
    return {
        "max_batch": max_batch,
        "max_prefill": max_prefill,
        "verify_tokens": verify,
        "profiles": profiles,
        "buffers": buffer_sizes(model, max_batch, max(max_prefill, *verify, 1)),
    }


def buffer_sizes(model: dict, max_batch: int, max_tokens: int) -> dict:
    """What the runtime allocates once: one [B, Hkv, S_max, D] buffer per past_* input, and the logits buffer."""
    itemsize = CACHE_DTYPE_BYTES[model["dtype"]]
    cache_shape = [max_batch, model["num_kv_heads"], model["max_seq_len"], model["head_dim"]]
    cache_bytes = itemsize * max_batch * model["num_kv_heads"] * model["max_seq_len"] * model["head_dim"]
    logits_shape = [max_batch, max_tokens, model["vocab_size"]]
    num_caches = len(model["kv_aliases"])
    return {
        "cache_shape": cache_shape,
        "cache_dtype": model["dtype"],
        "cache_tensor_bytes": cache_bytes,
        "num_cache_tensors": num_caches,
        "cache_bytes_total": cache_bytes * num_caches,
        "logits_shape": logits_shape,
        "logits_dtype": model["dtype"],  # the step graph's logits have the model's dtype
        "logits_bytes": itemsize * max_batch * max_tokens * model["vocab_size"],
        "token_buffer_elements": max_batch * max_tokens,  # input_ids and position_ids, int64 each
    }
