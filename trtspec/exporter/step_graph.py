"""HF model directory -> export/<name>/: step graph (ONNX opset 24), manifest.json, tokenizer files."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

from ..errors import UnsupportedModelError
from ..manifest import EXPORT_FORMAT, atomic_artifact, sha256_file, versions
from .architectures import arch_spec
from .contract import DEFAULT_MAX_CALL_TOKENS, cache_slots, check_step_graph, io_names, parse_hidden_states

OPSET = 24
GRAPH_FILE = "model.onnx"
DTYPES = ("float32", "float16")  # the ONNX export's: what onnxruntime's CPU kernels and our engines take
# the torch backend also runs bfloat16, the dtype GPU users run
TORCH_DTYPES = (*DTYPES, "bfloat16")
# Above this many weight bytes the initializers go to model.onnx.data (protobuf stops at 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30

log = logging.getLogger("trtspec.export")


def _tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary and the special tokens."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _special_tokens(config, generation_config, tokenizer) -> dict:
    def ids(value):
        if value is None:
            return []
        return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]

    eos = ids(getattr(generation_config, "eos_token_id", None)) or ids(config.eos_token_id) or ids(tokenizer.eos_token_id)
    bos = getattr(config, "bos_token_id", None)
    bos = tokenizer.bos_token_id if bos is None else bos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else getattr(config, "pad_token_id", None)
    return {"bos_token_id": bos, "eos_token_ids": eos, "pad_token_id": pad}


def load_for_step(model_dir: Path, max_seq_len: int, max_batch: int, dtype: str, dtypes: tuple = DTYPES):
    """Check the step options, load the HF model and tokenizer, and refuse what cannot be stepped."""
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(dtypes)}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2 (got {max_seq_len})")
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1 (got {max_batch})")
    config, spec, tokenizer, generation_config, hf = _load_hf(model_dir, dtype, max_seq_len)
    if spec.family == "gpt2" and max_seq_len > config.n_positions:
        raise UnsupportedModelError(
            f"max_seq_len {max_seq_len} exceeds the model's {config.n_positions} learned positions; "
            f"use --max-seq-len {config.n_positions} or less"
        )
    if len(tokenizer) > spec.vocab_size:
        raise UnsupportedModelError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {spec.vocab_size}; "
            "they do not belong together"
        )
    return config, spec, tokenizer, generation_config, hf


def cache_layout(spec, max_seq_len: int, max_call_tokens: int | None, ring_cache: bool) -> tuple[list[int], int]:
    """(slots per layer, tokens one call may carry): rings for sliding-window layers where they are smaller."""
    windows = spec.sliding_windows
    if max_call_tokens is None:
        max_call_tokens = min(DEFAULT_MAX_CALL_TOKENS, max_seq_len)
    elif not isinstance(max_call_tokens, int) or not 1 <= max_call_tokens <= max_seq_len:
        raise ValueError(f"max_call_tokens must be an integer in [1, max_seq_len={max_seq_len}], got {max_call_tokens!r}")
    slots = cache_slots(windows, max_seq_len, max_call_tokens, ring_cache=ring_cache)
    # without a ring a call may carry the whole cache
    return slots, (max_call_tokens if min(slots) < max_seq_len else max_seq_len)


def describe_tree_and_features(model: dict, spec, tree: bool, hidden_states) -> list[int]:
    """Record a tree_mask input (``tree_verify``) and a hidden_states output (its HF layer indices and width) in a
    manifest's model section; returns those layer indices ([] without features)."""
    layers = parse_hidden_states(hidden_states, spec.num_layers)
    if tree:
        model["tree_verify"] = True
    if layers:
        model["hidden_states"] = {"layers": layers, "size": len(layers) * spec.hidden_size}
    return layers


def model_description(spec, config, generation_config, tokenizer, hf, max_seq_len, max_batch, dtype, *,
                      max_call_tokens: int | None = None, ring_cache: bool = True) -> dict:
    """The manifest's "model" section every backend shares: what the runtime needs to know of the step."""
    from .contract import io_names

    slots, call_tokens = cache_layout(spec, max_seq_len, max_call_tokens, ring_cache)
    return {
        "architecture": spec.model_type,
        "vocab_size": spec.vocab_size,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_seq_len": max_seq_len,
        "max_batch": max_batch,
        "dtype": dtype,
        "sliding_windows": list(spec.sliding_windows),
        "cache_slots": slots,
        "max_call_tokens": call_tokens,
        "kv_aliases": io_names(spec.num_layers).aliases,
        "special_tokens": _special_tokens(config, generation_config, tokenizer),
        "tokenizer_fingerprint": _tokenizer_fingerprint(tokenizer),
        "weight_bytes": sum(p.numel() * p.element_size() for p in {id(p): p for p in hf.parameters()}.values()),
    }


def _load_hf(model_dir: Path, dtype: str, max_seq_len: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from . import gguf

    gguf_file = gguf.find_gguf(model_dir)
    if gguf_file is not None:
        config, tokenizer, generation_config, model = gguf.load(gguf_file, dtype)
        spec = arch_spec(config)
        _check_longrope(spec, max_seq_len)
        return config, spec, tokenizer, generation_config, model
    if not (model_dir / "config.json").is_file():
        raise UnsupportedModelError(f"{model_dir} has no config.json; pass a Hugging Face model directory or a "
                                    "GGUF file")
    config = AutoConfig.from_pretrained(model_dir)
    spec = arch_spec(config)  # refuse unsupported models before loading any weights
    _check_longrope(spec, max_seq_len)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as e:
        raise UnsupportedModelError(
            f"{model_dir} has no usable tokenizer ({type(e).__name__}); the runtime needs one. "
            "Save the model's tokenizer into the directory with tokenizer.save_pretrained(...)"
        ) from None
    try:
        generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        generation_config = None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    return config, spec, tokenizer, generation_config, model


def _check_longrope(spec, max_seq_len: int) -> None:
    if spec.longrope_max_len is not None and max_seq_len > spec.longrope_max_len:
        raise UnsupportedModelError(
            f"LongRoPE switches to its long factors for sequences over {spec.longrope_max_len} tokens (the model's "
            f"original length), which a fixed cache cannot tabulate; use --max-seq-len {spec.longrope_max_len} or less"
        )


def _linear_weights(model) -> dict:
    """{MatMul node name: its constant weight [out, in]} for the graph's named linear layers (a tied head reads
    the embedding through a Transpose)."""
    out = {}
    for node in model.graph.all_nodes():
        if node.op_type != "MatMul" or "." not in node.name and node.name != "lm_head":
            continue
        w = node.inputs[1]
        if w.const_value is not None and len(w.shape) == 2:
            out[node.name] = w.const_value.numpy().T
        elif w.producer() is not None and w.producer().op_type == "Transpose":
            src = w.producer().inputs[0]
            if src.const_value is not None and len(src.shape) == 2:
                out[node.name] = src.const_value.numpy()
    return out


def _keep_gguf_blocks(gguf_file: Path, program, hf, spec, dtype: str) -> tuple[dict, dict]:
    """The GGUF's blocks for the graph's linear layers (gguf.py): (arrays, the manifest's "gguf" section)."""
    from ..progress import Progress
    from . import gguf

    section = {"file": gguf_file.name, "sha256": sha256_file(gguf_file), **gguf.describe(gguf_file)}
    if dtype != "float32":
        section["kept"], section["not_kept"] = {}, {"*": f"a {dtype} export: blocks are kept for float32 exports only"}
        return {}, section
    linears = _linear_weights(program.model)
    progress = Progress("checking the GGUF's blocks against the weights", len(linears), "layer", log)
    arrays, found = gguf.keep_blocks(gguf_file, hf, linears, spec.num_heads, spec.num_kv_heads, progress)
    progress.close()
    section.update(found)
    types: dict[str, int] = {}
    for info in found["kept"].values():
        types[info["type"]] = types.get(info["type"], 0) + 1
    log.info("GGUF blocks kept for %d of %d linear layers (%s)%s", len(found["kept"]), len(linears),
             ", ".join(f"{k} x{v}" for k, v in sorted(types.items())) or "none",
             f"; {len(found['not_kept'])} left to the build's own 4-bit quantization" if found["not_kept"] else "")
    return arrays, section


def _batch_size_from_input_ids(model) -> None:
    """Make Shape nodes that read the batch size off a cache input read it off input_ids instead.

    The exporter takes a symbolic size from whichever input has it; when it picks
    a past_* cache, that input gets a second consumer besides its TensorScatter.
    """
    graph = model.graph
    input_ids = graph.inputs[0]
    for node in graph.all_nodes():
        if node.op_type != "Shape" or not node.inputs[0].name.startswith("past_"):
            continue
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", None)
        if start == 0 and end == 1:
            node.replace_input_with(0, input_ids)


def _name_linear_nodes(model) -> None:
    """Name each MatMul/Gemm after its module (``layers.0.self_attn.q_proj``, ``lm_head``).

    The names come from the exporter's name scopes, which are dropped with the
    rest of the metadata; quantization reports and `trtspec check` quote them.
    """
    import ast

    taken = {node.name for node in model.graph.all_nodes()}
    for node in model.graph.all_nodes():
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        try:
            scopes = ast.literal_eval(node.metadata_props.get("pkg.torch.onnx.name_scopes", "[]"))
        except (ValueError, SyntaxError):
            continue
        module = scopes[-2] if len(scopes) >= 2 else ""
        if module and module not in taken:
            taken.add(module)
            node.name = module


def export(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_seq_len: int = 512,
    max_batch: int = 4,
    dtype: str = "float32",
    max_call_tokens: int | None = None,
    ring_cache: bool = True,
    tree: bool = False,
    hidden_states=None,
) -> Path:
    """Export a Hugging Face causal LM directory to a step graph artifact; returns out_dir.

    Sliding-window layers keep a ring buffer of window + max_call_tokens - 1 slots (default max_call_tokens 128)
    where that is smaller than max_seq_len; calls then carry at most max_call_tokens tokens. ``ring_cache=False``
    keeps full-size caches (TensorRT's KV cache update has no circular mode).

    ``tree=True`` adds the ``tree_mask`` input (one call verifies a token tree); ``hidden_states`` ("low,mid,high",
    "last" or layer indices) adds the ``hidden_states`` output draft heads read (exporter/contract.py)."""
    import onnx
    import torch

    if not log.isEnabledFor(logging.DEBUG):
        # torch configures its loggers when imported; its exporter's notes (e.g. "torchvision is not
        # installed") only with -v
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)

    from .attention_op import TRANSLATION_TABLE as ATTENTION_TABLE
    from .kv_cache_op import TRANSLATION_TABLE
    from .step_model import StepModel

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    t0 = time.perf_counter()
    config, spec, tokenizer, generation_config, hf = load_for_step(model_dir, max_seq_len, max_batch, dtype)

    model = model_description(spec, config, generation_config, tokenizer, hf, max_seq_len, max_batch, dtype,
                              max_call_tokens=max_call_tokens, ring_cache=ring_cache)
    layers = describe_tree_and_features(model, spec, tree, hidden_states)
    step = StepModel(hf, spec, max_seq_len, cache_slots=model["cache_slots"], tree=tree, hidden_layers=layers).eval()
    names = io_names(spec.num_layers, tree=tree, hidden_states=bool(layers))
    tdtype = getattr(torch, dtype)
    # Example batch 2 and T 3: with 1 the exporter may specialise the dimension (DESIGN.md §2).
    b, t = 2, min(3, model["max_call_tokens"])
    caches = [torch.zeros((b, spec.num_kv_heads, model["cache_slots"][i // 2], spec.head_dim), dtype=tdtype)
              for i in range(2 * spec.num_layers)]
    tree_args = [torch.tril(torch.ones(t, t, dtype=torch.bool)).repeat(b, 1, 1)] if tree else []
    args = (torch.zeros(b, t, dtype=torch.long), torch.arange(t).repeat(b, 1), *tree_args, *caches)
    batch = torch.export.Dim("batch", min=1, max=max(max_batch, 2))
    seq = torch.export.Dim("seq", min=1, max=model["max_call_tokens"])
    dynamic_shapes = {
        "input_ids": {0: batch, 1: seq},
        "position_ids": {0: batch, 1: seq},
        "past": tuple([{0: batch, 1: seq, 2: seq}] * len(tree_args) + [{0: batch}] * (2 * spec.num_layers)),
    }
    rings = sum(n < max_seq_len for n in model["cache_slots"])
    if rings:
        log.info("sliding-window layers keep rings (%d layers, %d slots of %d); calls carry at most %d tokens", rings,
                 min(model["cache_slots"]), max_seq_len, model["max_call_tokens"])
    log.info("exporting %s (%s, %d layers, %.1f MB of weights)", model_dir, spec.model_type, spec.num_layers,
             model["weight_bytes"] / 1e6)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            step,
            args,
            dynamo=True,
            opset_version=OPSET,
            input_names=names.inputs,
            output_names=names.outputs,
            dynamic_shapes=dynamic_shapes,
            custom_translation_table={**TRANSLATION_TABLE, **ATTENTION_TABLE},
            verbose=False,
        )
    _batch_size_from_input_ids(program.model)
    _name_linear_nodes(program.model)
    for node in program.model.graph.all_nodes():
        node.metadata_props.clear()  # stack traces with local paths; not part of the artifact

    from . import gguf

    gguf_file = gguf.find_gguf(model_dir)
    blocks, source = {}, {"model_dir": str(model_dir.resolve())}
    if gguf_file is None:
        source["config_sha256"] = sha256_file(model_dir / "config.json")
    manifest = {
        "format": EXPORT_FORMAT,
        "graph": GRAPH_FILE,
        "model": {**model, "opset": OPSET, "inputs": names.inputs, "outputs": names.outputs},
        "config": config.to_dict(),
        "source": source,
        "versions": versions("torch", "transformers", "onnx", "onnxscript", *(("gguf",) if gguf_file else ())),
    }
    if gguf_file is not None:
        blocks, manifest["gguf"] = _keep_gguf_blocks(gguf_file, program, hf, spec, dtype)
        source["gguf_sha256"] = manifest["gguf"]["sha256"]
    with atomic_artifact(out_dir, manifest) as tmp:
        if blocks:
            import numpy as np

            np.savez(tmp / gguf.BLOCKS_FILE, **blocks)
            manifest["gguf"]["blocks"] = gguf.BLOCKS_FILE
        graph_path = tmp / GRAPH_FILE
        program.save(graph_path, external_data=model["weight_bytes"] > EXTERNAL_DATA_BYTES)
        onnx.checker.check_model(str(graph_path), full_check=True)
        check_step_graph(onnx.load(str(graph_path), load_external_data=False), spec.num_layers, tree=tree,
                         hidden_states=bool(layers))
        tokenizer.save_pretrained(tmp / "tokenizer")
        manifest["tokenizer"] = "tokenizer"
    log.info("wrote %s in %.1f s", out_dir, time.perf_counter() - t0)
    return out_dir
