"""`trtspec build --backend torch`: the torch engine compiled ahead of time, as a TensorRT plan is.

torch.export traces the step module (StepModel over the export's model, or over an HF directory's or a GGUF file's
without an export, which this backend does not need; for a GGUF file its linear layers on our GGUF kernels, the
file's own blocks) with the caches as inputs it writes in place and dynamic rows,
tokens and live length; AOTInductor compiles that into one shared library, weights inside, in a .pt2 package.
engines/torch_aot.py loads it: no compile, no Python per op.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from .. import kernels
from ..engines.torch_aot import CACHE_PAD, LIVE_STEP, PACKAGE, cpu_isa, kernel_schema, require_native_kernels
from ..exporter.contract import max_call_tokens
from ..exporter.gguf import find_gguf
from ..errors import ArtifactError
from ..kernels import build as kernel_build
from ..manifest import ENGINE_FORMAT, atomic_artifact, carry_files, export_source, sha256_file, versions
from .cached_step import split_outputs
from .engine import DEVICES, step_module
from .source import load_source

log = logging.getLogger("trtspec.torch")


# How inductor splits the package's loops between threads. It decides once, at build time, from the example's sizes
# and a thread count: with this machine's 2 and the example's 2 rows, it split attention between rows only, so a
# one-row call ran attention on one thread while the other waited. Planned for 8 threads it splits rows x heads
# (x tokens); dynamic threads: the loaded package uses however many threads torch has where it runs, and its
# reductions size their per-thread arrays then, not from the machine that built it.
# precompile_headers off: making them cost a first build about 9 s on 2 cores and saved a later one about 2 s.
# The wrapper (the C++ that calls each kernel in turn) compiled at -O0, not inductor's -O1: 5 s less to build
# SmolLM2's, and its calls take the same time (the kernels' own loops are compiled apart, optimized as before).
COMPILE_CONFIG = {"cpp.threads": 8, "cpp.dynamic_threads": True, "aot_inductor.precompile_headers": False}
if hasattr(torch._inductor.config.aot_inductor, "compile_wrapper_opt_level"):
    COMPILE_CONFIG["aot_inductor.compile_wrapper_opt_level"] = "O0"
TOKENIZER = "tokenizer"  # where an engine built without an export keeps its tokenizer


@contextlib.contextmanager
def _without_input_checks():
    """AOTInductor writes a check function per graph input (dtype, sizes, strides, device: ~100 lines each) that
    runs only with AOTI_RUNTIME_CHECK_INPUTS=1. With 60 cache inputs they are half the wrapper's C++ and a good part
    of its compile; engines/torch_aot.py checks every call itself (check_call), so the package gets an empty one (the
    variable still switches on the checks of each op's outputs that the wrapper writes inline)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    def empty(self):
        # torch 2.13's prefix is two buffers and the checks go to the AOT one; 2.11's is one buffer
        splice = getattr(self.prefix, "splice_aot", None) or self.prefix.splice
        splice("""
            static bool _check_aoti_runtime_check_inputs_env() {
                const static char* env_var_value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
                const static bool result = env_var_value != nullptr && env_var_value[0] != '0';
                return result;
            }

            AOTI_NOINLINE static void __check_inputs_outputs(
                AtenTensorHandle* input_handles,
                AtenTensorHandle* output_handles) {}
        """)

    if not hasattr(CppWrapperCpu, "generate_input_output_runtime_checks"):
        yield
        return
    with mock.patch.object(CppWrapperCpu, "generate_input_output_runtime_checks", empty):
        yield


@contextlib.contextmanager
def compiling(shims: dict):
    """What an AOTInductor compile of ours runs under: COMPILE_CONFIG (with ``shims``, kernels.c_shims() or {}), no
    input checks, and without the FutureWarning torch 2.13 prints about its own code while it copies the exported
    program (`isinstance(treespec, LeafSpec)` is deprecated: twice in every `make demo`, nothing a user can act on)."""
    config = dict(COMPILE_CONFIG)
    if shims:
        config["aot_inductor.custom_ops_to_c_shims"] = shims
    with torch._inductor.config.patch(config), _without_input_checks(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


class AOTStep(nn.Module):
    """The package's signature (engines/torch_aot.py): (input_ids, position_ids, tree_mask | live, *caches)
    -> logits[, hidden_states]; attention reads a full-length cache's first len(live) slots (max_seq_len: trees),
    cut inside the step after the call's write, so the caches stay graph inputs written in place."""

    def __init__(self, step: nn.Module, live: bool = True):
        super().__init__()
        self.step = step
        self.live = live  # False: no live input, every call attends the whole capacity (the CUDA build)

    def forward(self, input_ids, position_ids, *args):
        if self.step.tree:  # (tree_mask, *caches): a tree call attends the whole capacity
            tree, caches, live = args[:1], args[1:], self.step.max_seq_len
        elif self.live:  # (live, *caches)
            tree, caches, live = (), args[1:], args[0].shape[0]
        else:  # (*caches)
            tree, caches, live = (), args, self.step.max_seq_len
        logits, hidden, _ = split_outputs(self.step, self.step(input_ids, position_ids, *tree, *caches, live=live))
        return logits if hidden is None else (logits, hidden)


def _example(model: dict, device: str, live: bool = True):
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
    elif live:
        args.append(torch.arange(min(4 * LIVE_STEP, seq), device=device))
        dims.append({0: Dim("live", min=1, max=seq)} if seq > 1 else {})
    dtype = getattr(torch, model["dtype"])
    caches = [torch.zeros((b, model["num_kv_heads"], n + CACHE_PAD * (n == seq), model["head_dim"]), dtype=dtype,
                          device=device) for n in model["cache_slots"] for _ in (0, 1)]
    # (forward's *args is one input to torch.export: its dimensions are one tuple)
    return (*args, *caches), (dims[0], dims[1], (*dims[2:], *({0: row} for _ in caches)))


def _compile_kernels() -> None:
    try:
        kernel_build.library()
    except Exception:  # noqa: BLE001 - require_native_kernels loads them again and reports why they could not be built
        pass


def _model_source(source) -> dict:
    """The ``source`` block of an engine built from the model itself: the file or directory, and its hash."""
    model_dir = Path(source.manifest["source"]["model_dir"])
    if source.gguf_file is not None:
        return {"model_dir": str(model_dir), "gguf_sha256": sha256_file(source.gguf_file)}
    return {"model_dir": str(model_dir), "config_sha256": sha256_file(model_dir / "config.json")}


def head_layers(head) -> list[int] | str:
    """The target layers an EAGLE-3 head's directory says it reads (its config.json), or EAGLE-3's own."""
    config = Path(head) / "config.json"
    if not config.is_file():
        raise ArtifactError(f"--head {head}: no config.json there; pass an EAGLE-3 head's directory (trtspec distill "
                            "--method eagle3, or the EAGLE authors' layout)")
    try:
        return json.loads(config.read_text()).get("target_layers") or "low,mid,high"
    except (OSError, ValueError) as e:
        raise ArtifactError(f"--head {head}: its config.json is not readable JSON ({e})") from None


def build_torch(path: Path, export_manifest: dict | None, out_dir: Path, *, weights: str | None = None,
                int8_activations: bool = False, device: str = "cpu", max_seq_len: int | None = None,
                max_batch: int | None = None, hidden_states=None, head=None, carry=None,
                live: bool | None = None) -> Path:
    """export/ (or, ``export_manifest`` None, an HF model directory or a GGUF file) -> engines/<name>/: the step
    module of the model as an AOTInductor package (step.pt2).

    ``weights``: "gguf" (the default for a GGUF file or its export: every linear layer of a type the kernels take
    runs them on the file's blocks; ``int8_activations``: their int8 variant) or "float" (the model's float
    weights, the default otherwise). ``device``: "cpu", or "cuda" for float weights where torch sees a GPU.
    ``max_seq_len`` and ``max_batch`` (default 512 and 4) size the cache of a model built without an export; an
    export has its own. ``hidden_states`` (built from the model itself) adds the features output, as export's
    option does; ``head`` (an EAGLE-3 head's directory, with ``carry``: builder.HEAD_CARRIERS) adds the features
    it reads and carries the head, exported for this engine, in ``head/`` (the manifest's ``head``).

    ``live`` (default: on the CPU only): a chain call attends only the cache slots it can read (a live-length input,
    engines/torch_aot.py). A CUDA build attends the whole capacity, as the torch engine's CUDA graphs do: traced for
    CUDA, the attention's strides over a dynamic live length gave a guard torch.export could not prove
    (``min(64*live, 128*live) != 256*live``), and the build failed."""
    t0 = time.perf_counter()
    exported = export_manifest is not None
    if exported and (max_seq_len is not None or max_batch is not None):
        raise ValueError(f"{path} is an export, whose --max-seq-len and --max-batch were fixed when it was exported; "
                         "drop them, or build from the model itself")
    gguf = "gguf" in export_manifest if exported else find_gguf(Path(path)) is not None
    weights = weights or ("gguf" if gguf else "float")
    if weights not in ("gguf", "float"):
        raise ValueError(f"unknown weights {weights!r}; choose gguf or float")
    if weights == "gguf" and not gguf:
        raise ValueError(f"{path} {'was not exported from' if exported else 'is not'} a GGUF file, so it has no "
                         "blocks for --weights gguf; drop --weights")
    if int8_activations and weights != "gguf":
        raise ValueError("--int8-activations goes with the GGUF kernels (--weights gguf, an export of a GGUF file)")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA GPU here; build with --device cpu")
    if weights == "gguf" and shutil.which(kernel_build.compiler()) is None:
        require_native_kernels("--backend torch --weights gguf")  # no compiler: refused now, before the model loads
    # while the model loads: the kernels compile and inductor probes the CPU's vector ISAs by compiling a test
    # program for each (each once per machine, cached; together about a third of a fresh machine's build)
    meanwhile = {name: threading.Thread(target=work, daemon=True)
                 for name, work, needed in (("kernels", _compile_kernels, weights == "gguf"),
                                            ("isa", cpu_isa, device == "cpu")) if needed}
    for thread in meanwhile.values():
        thread.start()
    if (head is not None or hidden_states is not None) and exported:
        raise ValueError("--head and --hidden-states apply to a build from the model itself (a GGUF file or an HF "
                         "directory): an export fixed its features when it was exported (trtspec export "
                         "--hidden-states low,mid,high)")
    if head is not None:
        if hidden_states is not None:
            raise ValueError("--head sets the hidden states the engine outputs (the ones the head reads): drop "
                             "--hidden-states")
        hidden_states = head_layers(head)
    source = load_source(path, max_seq_len=max_seq_len, max_batch=max_batch, dtype=None, hidden_states=hidden_states)
    if weights == "gguf":
        meanwhile["kernels"].join()
        require_native_kernels("--backend torch --weights gguf")
    # int8 activations round each row's inputs, so a row must get the same bits in every call, attention and
    # float layers included: else a verify call's logits could differ from a decode call's
    step, report = step_module(source, device=device, weights=weights, int8_activations=int8_activations,
                               rowwise=int8_activations)
    model = source.manifest["model"]
    live = device == "cpu" if live is None else live
    build = {"weights": weights, "int8_activations": int8_activations, "rowwise": int8_activations,
             "device": device, "live": live, "torch": torch.__version__}
    if report is not None:
        build["gguf"] = {"kernels": len(report["kernels"]), "float": report["float"]}
        build["kernel_schema"] = kernel_schema()
    manifest = {"format": ENGINE_FORMAT, "backend": "torch", "graph": PACKAGE,
                "tokenizer": export_manifest["tokenizer"] if exported else TOKENIZER, "model": model, "build": build,
                "source": export_source(path) if exported else _model_source(source), "versions": versions("torch")}
    with atomic_artifact(out_dir, manifest) as tmp, torch.no_grad(), contextlib.ExitStack() as pending:
        if not exported:
            source.tokenizer.save_pretrained(tmp / TOKENIZER)
        if head is not None:
            # made in a second process while this one compiles the target (heads/carried.py), taking the target's
            # embedding as loaded here (a head without one of its own takes it), not the file read again
            embedding = source.hf_model.get_input_embeddings().weight.detach()
            head_done = carry(head, tmp, manifest, path, embedding=embedding)
            pending.callback(head_done, cancel=True)  # any way out of the build stops it, if it still runs
        args, dims = _example(model, device, live)
        t = time.perf_counter()
        log.info("torch.export of the step module (%d layers, dynamic rows, tokens%s)", model["num_layers"],
                 " and live length" if live and not model.get("tree_verify") else "")
        program = torch.export.export(AOTStep(step, live).eval(), args, dynamic_shapes=dims, strict=False)
        # what the compile's cost grows with (docs/kernels.md, "What it costs to build")
        build["traced_ops"] = sum(node.op == "call_function" for node in program.graph.nodes)
        if device == "cpu":  # the vector instructions inductor compiles for: the best here, or ATEN_CPU_CAPABILITY's
            meanwhile["isa"].join()
            build["cpu_isa"] = cpu_isa()
        log.info("AOTInductor: compiling the step into %s (about 30 s on 2 cores)", PACKAGE)
        shims = kernels.c_shims() if report is not None and device == "cpu" else {}
        if shims:
            # the kernels called as C functions, not through the dispatcher (kernels.c_shims): the package then
            # needs the kernel library loaded before it, as kernel_schema's check at load makes sure
            build["kernel_calls"] = "c_shims"
        with compiling(shims):
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp / PACKAGE))
        build["compile_s"] = round(time.perf_counter() - t, 1)
        if exported:
            carry_files(path, export_manifest, tmp)
        if head is not None:
            manifest["head"] = head_done()
    log.info("wrote %s in %.1f s", out_dir, time.perf_counter() - t0)
    return out_dir
