"""`trtspec build --backend torch`: the torch engine compiled ahead of time, as a TensorRT plan is.

torch.export traces the step module (StepModel over the export's model; for an export of a GGUF file its linear
layers on our GGUF kernels, the file's own blocks) with the caches as inputs it writes in place and dynamic rows,
tokens and live length; AOTInductor compiles that into one shared library, weights inside, in a .pt2 package.
engines/torch_aot.py loads it: no compile, no Python per op.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from ..engines.torch_aot import CACHE_PAD, LIVE_STEP, PACKAGE, cpu_isa, kernel_schema, require_native_kernels
from ..exporter.contract import max_call_tokens
from ..manifest import ENGINE_FORMAT, atomic_artifact, carry_files, export_source, versions
from .cached_step import split_outputs
from .engine import DEVICES, step_module
from .source import load_source

log = logging.getLogger("trtspec.torch")


# How inductor splits the package's loops between threads. It decides once, at build time, from the example's sizes
# and a thread count: with this machine's 2 and the example's 2 rows, it split attention between rows only, so a
# one-row call ran attention on one thread while the other waited. Planned for 8 threads it splits rows x heads
# (x tokens); dynamic threads: the loaded package uses however many threads torch has where it runs, and its
# reductions size their per-thread arrays then, not from the machine that built it.
COMPILE_CONFIG = {"cpp.threads": 8, "cpp.dynamic_threads": True}


class AOTStep(nn.Module):
    """The package's signature (engines/torch_aot.py): (input_ids, position_ids, tree_mask | live, *caches)
    -> logits[, hidden_states]; attention reads a full-length cache's first len(live) slots (max_seq_len: trees),
    cut inside the step after the call's write, so the caches stay graph inputs written in place."""

    def __init__(self, step: nn.Module):
        super().__init__()
        self.step = step

    def forward(self, input_ids, position_ids, *args):
        if self.step.tree:  # (tree_mask, *caches): a tree call attends the whole capacity
            tree, caches, live = args[:1], args[1:], self.step.max_seq_len
        else:  # (live, *caches)
            tree, caches, live = (), args[1:], args[0].shape[0]
        logits, hidden, _ = split_outputs(self.step, self.step(input_ids, position_ids, *tree, *caches, live=live))
        return logits if hidden is None else (logits, hidden)


def _example(model: dict, device: str):
    """Example inputs and their dynamic dimensions: rows, tokens and live length (examples of 2 or more, which
    torch.export does not specialise; inductor splits loops between threads by these sizes, so tokens and live
    length are a verify call's and a context's, not the least that would trace)."""
    from torch.export import Dim

    rows, seq = model["max_batch"], model["max_seq_len"]
    tokens = min(max_call_tokens(model), seq)
    b, t = min(2, rows), min(8, tokens)
    ids = torch.ones((b, t), dtype=torch.long, device=device)
    pos = torch.arange(t, device=device).repeat(b, 1)
    row = Dim("rows", min=1, max=rows) if rows > 1 else None
    tok = Dim("tokens", min=1, max=tokens) if tokens > 1 else None
    args, dims = [ids, pos], [{0: row, 1: tok}, {0: row, 1: tok}]
    if model.get("tree_verify"):
        args.append(torch.ones((b, t, t), dtype=torch.bool, device=device))
        dims.append({0: row, 1: tok, 2: tok})
    else:
        args.append(torch.arange(min(4 * LIVE_STEP, seq), device=device))
        dims.append({0: Dim("live", min=1, max=seq)} if seq > 1 else {})
    dtype = getattr(torch, model["dtype"])
    caches = [torch.zeros((b, model["num_kv_heads"], n + CACHE_PAD * (n == seq), model["head_dim"]), dtype=dtype,
                          device=device) for n in model["cache_slots"] for _ in (0, 1)]
    # (forward's *args is one input to torch.export: its dimensions are one tuple)
    return (*args, *caches), (dims[0], dims[1], (*dims[2:], *({0: row} for _ in caches)))


def build_torch(export_dir: Path, export_manifest: dict, out_dir: Path, *, weights: str | None = None,
                int8_activations: bool = False, device: str = "cpu") -> Path:
    """export/ -> engines/<name>/: the step module of the export's model as an AOTInductor package (step.pt2).

    ``weights``: "gguf" (the default for an export of a GGUF file: every linear layer of a type the kernels take
    runs them on the file's blocks; ``int8_activations``: their int8 variant) or "float" (the model's float
    weights, the default otherwise). ``device``: "cpu", or "cuda" for float weights where torch sees a GPU."""
    t0 = time.perf_counter()
    gguf = "gguf" in export_manifest
    weights = weights or ("gguf" if gguf else "float")
    if weights not in ("gguf", "float"):
        raise ValueError(f"unknown weights {weights!r}; choose gguf or float")
    if weights == "gguf" and not gguf:
        raise ValueError(f"{export_dir} was not exported from a GGUF file, so it has no blocks for --weights gguf; "
                         "drop --weights")
    if int8_activations and weights != "gguf":
        raise ValueError("--int8-activations goes with the GGUF kernels (--weights gguf, an export of a GGUF file)")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA GPU here; build with --device cpu")
    if weights == "gguf":
        require_native_kernels("--backend torch --weights gguf")
    source = load_source(export_dir, max_seq_len=None, max_batch=None, dtype=None)
    # int8 activations round each row's inputs, so a row must get the same bits in every call, attention and
    # float layers included: else a verify call's logits could differ from a decode call's
    step, report = step_module(source, device=device, weights=weights, int8_activations=int8_activations,
                               rowwise=int8_activations)
    model = source.manifest["model"]
    build = {"weights": weights, "int8_activations": int8_activations, "rowwise": int8_activations,
             "device": device, "torch": torch.__version__}
    if device == "cpu":  # the vector instructions inductor compiles for: the machine's best
        build["cpu_isa"] = cpu_isa()
    if report is not None:
        build["gguf"] = {"kernels": len(report["kernels"]), "float": report["float"]}
        build["kernel_schema"] = kernel_schema()
    manifest = {"format": ENGINE_FORMAT, "backend": "torch", "graph": PACKAGE, "tokenizer": export_manifest["tokenizer"],
                "model": model, "build": build, "source": export_source(export_dir), "versions": versions("torch")}
    with atomic_artifact(out_dir, manifest) as tmp, torch.no_grad():
        args, dims = _example(model, device)
        t = time.perf_counter()
        log.info("torch.export of the step module (%d layers, dynamic rows, tokens and live length)",
                 model["num_layers"])
        program = torch.export.export(AOTStep(step).eval(), args, dynamic_shapes=dims, strict=False)
        log.info("AOTInductor: compiling the step into %s (about a minute on 2 cores)", PACKAGE)
        with torch._inductor.config.patch(COMPILE_CONFIG):
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp / PACKAGE))
        build["compile_s"] = round(time.perf_counter() - t, 1)
        carry_files(export_dir, export_manifest, tmp)
    log.info("wrote %s in %.1f s", out_dir, time.perf_counter() - t0)
    return out_dir
