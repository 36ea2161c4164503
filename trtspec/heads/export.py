"""An EAGLE-3 head -> its own step graph artifact (export format), run by the onnxruntime engine like any model.

The graph keeps the step contract's cache handling (a one-layer KV cache written in place by TensorScatter,
the mask ``slot <= position``) and adds two float inputs and an output:

    inputs   input_ids [B, T] (the token after each position), position_ids [B, T],
             features [B, T, 3 H_target] (the target's fused hidden states; zeros for drafted positions),
             hidden_in [B, T, H] (the head's own previous output; zeros where features are given),
             past_key_0, past_value_0 [B, Hkv, S_max, D]
    outputs  logits [B, T, V_draft], hidden_states [B, T, H] (for the next drafted position), present_*

The manifest's model section says so (``extra_inputs``, ``logits_size``, ``hidden_states``, ``head``); the draft
vocabulary's map to target ids is ``draft_to_target.npy``. Sizes (S_max, batch rows, tokenizer) come from the
target the head drafts for, whose features must be the ones the head was trained on.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import numpy as np

from ..errors import ArtifactError
from ..manifest import EXPORT_FORMAT, atomic_artifact, read_manifest, versions
from ..runtime.drafters.eagle3 import DRAFT_TO_TARGET, draft_to_target, feature_columns

log = logging.getLogger("trtspec.export")
GRAPH = "model.onnx"
KIND = "eagle3"


def _step_module(head, max_seq_len: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ..exporter.kv_cache_op import kv_cache_write

    c = head.config

    class Eagle3Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head
            self.register_buffer("slots", torch.arange(max_seq_len), persistent=False)

        def forward(self, input_ids, position_ids, features, hidden_in, past_key, past_value):
            emb = self.head.embed_tokens(input_ids)
            hidden = self.head.fc(features) + hidden_in
            q, k, v = self.head.qkv(emb, hidden, position_ids)
            write = position_ids[:, 0]
            present_key = kv_cache_write(past_key, k, write)
            present_value = kv_cache_write(past_value, v, write)
            mask = (self.slots <= position_ids[:, None, :, None])
            y = F.scaled_dot_product_attention(q, present_key, present_value, attn_mask=mask, scale=c.head_dim**-0.5,
                                               enable_gqa=c.num_attention_heads != c.num_key_value_heads)
            out = self.head.finish(hidden, y)
            return self.head.logits(out), out, present_key, present_value

    return Eagle3Step().eval()


def _weights_in_blocks(graph: Path, bits: int) -> None:
    """The graph's MatMuls with constant weights rewritten as MatMulNBits (onnxruntime's weight-only quantizer)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if bits not in (4, 8):
        raise ValueError(f"weight_bits must be 4 or 8, got {bits}")
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=bits)
        q = MatMulNBitsQuantizer(onnx.load(str(graph)), bits=bits, block_size=32, is_symmetric=True,
                                 accuracy_level=4, algo_config=config)
        q.process()
    finally:
        quiet.setLevel(level)
    onnx.save(q.model.model, str(graph))


def _model_dir(manifest: dict) -> Path | None:
    """The HF model directory an export (or the export behind an engine) was made from, if it is still there."""
    source = manifest.get("source") or {}
    if source.get("model_dir"):
        path = Path(source["model_dir"])
    elif source.get("export_dir") and (Path(source["export_dir"]) / "manifest.json").is_file():
        return _model_dir(read_manifest(source["export_dir"]))
    else:
        return None
    from ..exporter.gguf import find_gguf

    return path if (path / "config.json").is_file() or find_gguf(path) is not None else None


def checked_head(head_dir, target: Path, target_manifest: dict, target_model=None, embedding=None):
    """The head in ``head_dir`` loaded for the target (its export or engine, with its manifest) -> (head, config,
    the target layers it reads); refused when the target lacks those features or is another model. ``embedding``:
    the target's, where the caller has it loaded (else read from the target's model when the head has none)."""
    from .eagle3 import default_layers, load_head

    model = target_manifest["model"]
    if model.get("head"):
        raise ArtifactError(f"{target} is a draft head, not a target model")
    head, config = load_head(head_dir, target_dir=target_model or _model_dir(target_manifest), embedding=embedding)
    layers = config.target_layers or default_layers(model["num_layers"])
    feature_columns(model, layers, config.target_hidden_size, "the EAGLE-3 head")  # refuses a target without them
    if config.vocab_size != model["vocab_size"]:
        raise ArtifactError(f"the head's vocabulary has {config.vocab_size} tokens, the target's {model['vocab_size']}: "
                            "this head was trained for another model")
    per_layer = model["hidden_states"]["size"] // len(model["hidden_states"]["layers"])
    if config.target_hidden_size != per_layer:
        raise ArtifactError(f"the head reads hidden states of {config.target_hidden_size} values per layer, the target's "
                            f"have {per_layer}: this head was trained for another model")
    return head, config, layers


def head_section(head, config, model: dict, layers, max_seq_len: int, max_batch: int) -> dict:
    """The manifest's model section of a head made for the target whose model section is ``model``."""
    return {
        "architecture": KIND, "head": KIND, "vocab_size": config.vocab_size, "logits_size": config.draft_vocab_size,
        "num_layers": 1, "num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "max_seq_len": max_seq_len, "max_batch": max_batch, "dtype": "float32",
        "sliding_windows": [None], "cache_slots": [max_seq_len], "max_call_tokens": max_seq_len,
        "kv_aliases": {"present_key_0": "past_key_0", "present_value_0": "past_value_0"},
        "extra_inputs": {"features": 3 * config.target_hidden_size, "hidden_in": config.hidden_size},
        "hidden_states": {"layers": [], "size": config.hidden_size}, "target_layers": layers,
        "special_tokens": model["special_tokens"], "tokenizer_fingerprint": model["tokenizer_fingerprint"],
        "weight_bytes": sum(p.numel() * p.element_size() for p in head.parameters()),
    }


def carry_head_files(tmp: Path, head, target: Path, target_manifest: dict, manifest: dict) -> None:
    """Into a head artifact being written: the draft vocabulary's map to target ids and the target's tokenizer."""
    np.save(tmp / DRAFT_TO_TARGET, (np.arange(head.config.draft_vocab_size) + head.d2t.numpy()).astype(np.int64))
    if target_manifest.get("tokenizer"):
        import shutil

        shutil.copytree(target / target_manifest["tokenizer"], tmp / target_manifest["tokenizer"])
        manifest["tokenizer"] = target_manifest["tokenizer"]


def export_head(head_dir, out_dir, *, target, target_model=None, max_seq_len: int | None = None,
                max_batch: int | None = None) -> Path:
    """Export the EAGLE-3 head in ``head_dir`` for ``target`` (its export or engine artifact, exported with
    ``--hidden-states low,mid,high``) into ``out_dir``; returns out_dir. A head without its own copy of the
    embedding takes the target's, from ``target_model`` (the HF directory; by default the one the target was
    exported from)."""
    return export_head_for(head_dir, out_dir, target=target, target_manifest=read_manifest(target),
                           target_model=target_model, max_seq_len=max_seq_len, max_batch=max_batch)


def export_head_for(head_dir, out_dir, *, target, target_manifest: dict, target_model=None,
                    max_seq_len: int | None = None, max_batch: int | None = None, weight_bits: int | None = None,
                    embedding=None) -> Path:
    """export_head for a target given with its manifest (heads/carried.py: an engine being written, whose
    manifest is not on disk yet). ``weight_bits`` 8 or 4: the head's matrices (its lm_head included) as
    onnxruntime's MatMulNBits, blocks of 32, symmetric, int8 activations (a head call reads its weights, so this
    is its cost: 1.24 -> 0.74 ms at 8 bits for SmolLM2's 10,240-token head); None keeps them float32."""
    import onnx
    import torch

    from ..exporter.kv_cache_op import TRANSLATION_TABLE
    from ..exporter.step_graph import OPSET

    t0 = time.perf_counter()
    target, out_dir = Path(target), Path(out_dir)
    head, config, layers = checked_head(head_dir, target, target_manifest, target_model, embedding)
    model = target_manifest["model"]
    max_seq_len = max_seq_len or model["max_seq_len"]
    max_batch = max_batch or model["max_batch"]
    step = _step_module(head, max_seq_len)
    d = config.head_dim
    b, t = 2, 3
    args = (torch.zeros(b, t, dtype=torch.long), torch.arange(t).repeat(b, 1),
            torch.zeros(b, t, 3 * config.target_hidden_size), torch.zeros(b, t, config.hidden_size),
            torch.zeros(b, config.num_key_value_heads, max_seq_len, d), torch.zeros(b, config.num_key_value_heads, max_seq_len, d))
    batch = torch.export.Dim("batch", min=1, max=max(max_batch, 2))
    seq = torch.export.Dim("seq", min=1, max=max_seq_len)
    names_in = ["input_ids", "position_ids", "features", "hidden_in", "past_key_0", "past_value_0"]
    names_out = ["logits", "hidden_states", "present_key_0", "present_value_0"]
    dyn = {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}, "features": {0: batch, 1: seq},
           "hidden_in": {0: batch, 1: seq}, "past_key": {0: batch}, "past_value": {0: batch}}
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(step, args, dynamo=True, opset_version=OPSET, input_names=names_in,
                                    output_names=names_out, dynamic_shapes=dyn, custom_translation_table=TRANSLATION_TABLE,
                                    verbose=False)
    for node in program.model.graph.all_nodes():
        node.metadata_props.clear()
    section = head_section(head, config, model, layers, max_seq_len, max_batch)
    section.update({"opset": OPSET, "inputs": names_in, "outputs": names_out})
    manifest = {"format": EXPORT_FORMAT, "graph": GRAPH, "model": section, "config": config.to_dict(),
                "source": {"head_dir": str(Path(head_dir).resolve()), "target": str(target.resolve())},
                "versions": versions("torch", "onnx", "onnxscript")}
    with atomic_artifact(out_dir, manifest) as tmp:
        program.save(tmp / GRAPH)
        if weight_bits is not None:
            _weights_in_blocks(tmp / GRAPH, weight_bits)
            section["weight_bits"] = weight_bits
        onnx.checker.check_model(str(tmp / GRAPH), full_check=True)
        carry_head_files(tmp, head, target, target_manifest, manifest)
    log.info("exported the EAGLE-3 head %s for %s in %.1f s", head_dir, target, time.perf_counter() - t0)
    return out_dir


__all__ = ["export_head", "draft_to_target"]
