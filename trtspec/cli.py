"""The `trtspec` command: export, quantize, check, build, generate, bench, serve, distill.

Each command calls the function of its name in `trtspec` with its options, whose names are the function's
parameters (tests/test_api.py); a command only parses its arguments and prints what the function returns.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import sys

from .server.launch import API_KEY_ENV
from .server.limits import MAX_BODY_BYTES, MAX_QUEUE
from .server.run import HEADER_TIMEOUT


def _call(function, args, **given):
    """``function`` called with the parsed options of its parameters' names, and ``given``."""
    names = [name for name in inspect.signature(function).parameters if name not in given]
    return function(**{name: getattr(args, name) for name in names}, **given)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _add_export(sub):
    p = sub.add_parser("export", help="HF model directory or GGUF file -> step graph artifact (ONNX, manifest, tokenizer)")
    p.add_argument("model_dir", help="an HF model directory, or a GGUF file (or a directory holding one)")
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="artifact directory to write (e.g. export/NAME)")
    p.add_argument("--max-seq-len", type=_positive_int, default=512, help="KV cache capacity per row, in tokens")
    p.add_argument("--max-batch", type=_positive_int, default=4, help="most rows (concurrent sequences) a call may carry")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="the graph's float type")
    p.add_argument("--max-call-tokens", type=_positive_int, default=None,
                   help="sliding-window models: most tokens a call carries (ring cache of window + N - 1 slots; "
                        "default 128)")
    p.add_argument("--no-ring-cache", dest="ring_cache", action="store_false",
                   help="full-size caches for sliding-window layers too (needed for TensorRT)")
    p.add_argument("--tree", action="store_true",
                   help="add a tree_mask input so one call verifies a token tree (for --tree-width > 1)")
    p.add_argument("--hidden-states", metavar="LAYERS",
                   help="add a hidden_states output for draft heads: low,mid,high (EAGLE-3), last (Medusa) or "
                        "layer indices (default: none)")

    def run(args):
        from . import export

        print(_call(export, args))

    p.set_defaults(run=run)


def _add_export_head(sub):
    p = sub.add_parser("export-head", help="EAGLE-3 head directory -> its step graph artifact, for one target")
    p.add_argument("head_dir", help="an EAGLE-3 head (from `trtspec distill --method eagle3`, or the EAGLE authors' layout)")
    p.add_argument("--target", required=True, help="the target's export or engine, exported with --hidden-states")
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="artifact directory to write")
    p.add_argument("--target-model", help="the target's HF directory, for a head without its own embedding "
                                          "(default: the one the target came from)")
    p.add_argument("--max-seq-len", type=_positive_int, help="the head's KV cache capacity (default: the target's)")
    p.add_argument("--max-batch", type=_positive_int, help="largest batch the head serves (default: the target's)")

    def run(args):
        from . import export_head

        print(_call(export_head, args))

    p.set_defaults(run=run)


def _add_quantize(sub):
    from .quantization.quantize import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, DEFAULT_CALIB_SAMPLES, MODES

    p = sub.add_parser("quantize", help="step graph artifact -> the same graph with INT8/FP8/INT4 weights in explicit Q/DQ form")
    p.add_argument("export_dir", help="an unquantized export artifact (e.g. export/NAME)")
    p.add_argument("-o", "--output", dest="out_dir", required=True,
                   help="artifact directory to write (e.g. export/NAME-int4-awq)")
    p.add_argument("--mode", required=True, choices=list(MODES),
                   help="int8-wo, int8-sq (W8A8, SmoothQuant), fp8 (E4M3), int4-rtn, int4-awq or int4-gptq "
                        "(docs/building.md)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, help=f"INT4 block size along K (default: {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--calib-file", help="calibration text: .txt, a .json list of strings, or .jsonl "
                                        "(default: text shipped with trtspec)")
    p.add_argument("--calib-samples", type=_positive_int,
                   help=f"calibration windows of up to 256 tokens (default: {DEFAULT_CALIB_SAMPLES})")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the lm_head too (a tied one: one INT4 table for both; default: keep it float)")
    p.add_argument("--no-act-order", dest="act_order", action="store_false", default=None,
                   help="int4-gptq: quantize input channels in order, not by decreasing activation energy")

    def run(args):
        from . import quantize

        print(_call(quantize, args))

    p.set_defaults(run=run)


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,3,5,9, got {text!r}") from None


def _add_check(sub):
    p = sub.add_parser("check", help="check a step graph artifact against TensorRT's documented ONNX support (CPU only)")
    p.add_argument("export_dir", help="an export artifact (e.g. export/NAME); exits 1 if a problem is found")

    def run(args):
        from . import check
        from .builder.tensorrt_check import format_report

        problems = _call(check, args)
        print(format_report(args.export_dir, problems))
        return 1 if problems else 0

    p.set_defaults(run=run)


def _add_build(sub):
    p = sub.add_parser("build", help="export artifact, GGUF file or HF directory -> engine artifact for a backend")
    p.add_argument("export_dir", help="an export artifact (export/NAME), or for --backend torch a GGUF file or HF "
                                      "directory")
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="engine directory to write (e.g. engines/NAME)")
    p.add_argument("--backend", choices=["onnxruntime", "tensorrt", "torch"],
                   help="default: torch for a GGUF file, an HF directory or a GGUF export (where the kernels "
                        "compile), else onnxruntime")
    ort_group = p.add_argument_group("onnxruntime only")
    gguf_group = p.add_argument_group("an export of a GGUF file (onnxruntime and torch)")
    ort_group.add_argument("--no-qdq-fusion", dest="fuse_qdq", action="store_false", default=None,
                           help="run a quantized graph's Q/DQ nodes as written, not onnxruntime's quantized kernels")
    gguf_group.add_argument("--weights", choices=["gguf", "float"],
                           help="gguf: run the file's own quantized blocks (default); float: the dequantized "
                                "float32 graph (onnxruntime)")
    gguf_group.add_argument("--int8-activations", action="store_true",
                           help="multiply the quantized blocks with int8-rounded activations, as llama.cpp does "
                                "(faster; docs/building.md)")
    ort_group.add_argument("--no-fusion", dest="fusion", action="store_false", default=None,
                           help="build the plain step graph, without the lowering to onnxruntime's fused kernels")
    torch_group = p.add_argument_group("torch only")
    torch_group.add_argument("--device", choices=["cpu", "cuda"],
                             help="where the torch engine runs (default: cpu; cuda takes float weights)")
    torch_group.add_argument("--max-seq-len", type=_positive_int,
                             help="built from a GGUF file or HF directory: KV cache capacity per row (default: 512)")
    torch_group.add_argument("--head", metavar="DIR",
                             help="an EAGLE-3 head for the engine to carry: --drafter eagle3/auto then need no "
                                  "--draft (default: none; docs/distilling.md)")
    torch_group.add_argument("--hidden-states", metavar="LAYERS",
                             help="built from a GGUF file or HF directory: a hidden_states output for draft heads, "
                                  "as export's option (default: none; --head sets it)")
    trt = p.add_argument_group("tensorrt only")
    trt.add_argument("--max-prefill", type=_positive_int,
                     help="most tokens per row in one prefill call (default: the KV cache capacity)")
    trt.add_argument("--verify-tokens", type=_int_list,
                     help="tokens of the verify profiles (k + 1), comma-separated (default: 2,3,4,5,6,7,8,9)")
    trt.add_argument("--max-batch", type=_positive_int,
                     help="most rows a call (default: the export's; torch from a GGUF file or HF directory: 4)")
    trt.add_argument("--workspace", dest="workspace_mib", type=_positive_int, metavar="MIB",
                     help="TensorRT workspace limit in MiB (default: TensorRT's)")
    trt.add_argument("--timing-cache", metavar="PATH",
                     help="TensorRT timing cache file, read if present and written after the build (default: none)")

    def run(args):
        from . import build

        print(_call(build, args))

    p.set_defaults(run=run)


def _add_index(sub):
    from .runtime.drafters.datastore import DEFAULT_PATTERNS

    p = sub.add_parser("index", help="files -> a datastore index that suffix decoding drafts from (--datastore)")
    p.add_argument("paths", nargs="+", help="files and directories to index (code, text, .jsonl of past answers)")
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="index directory to write (e.g. index/NAME)")
    p.add_argument("--tokenizer", required=True, help="the engine (or export) whose tokenizer the index is for")
    p.add_argument("--patterns", nargs="+", default=DEFAULT_PATTERNS, metavar="GLOB",
                   help="file patterns searched in directories (default: common code and text files)")

    def run(args):
        from . import index

        print(_call(index, args))

    p.set_defaults(run=run)


K_POLICIES = ("load-aware", "fixed")  # the scheduler's (runtime/scheduler.py), without importing it here


def _add_engine_arguments(p) -> None:
    """The engine and drafting arguments that `generate` and `serve` share."""
    p.add_argument("--target", required=True, help="the target's engine (or export) directory")
    p.add_argument("--draft", help="the draft's engine directory, an exported head, or `self` (the target's own INT4 "
                                   "build; default: none)")
    p.add_argument("--drafter", choices=["draft", "eagle3", "medusa", "prompt_lookup", "suffix", "auto", "none"],
                   help="how drafts are made (default: auto with a carried head, draft with --draft, else none; "
                        "docs/generating.md)")
    p.add_argument("-k", "--num-draft-tokens", type=_positive_int, default=4,
                   help="most tokens drafted a round (default: 4)")
    p.add_argument("--k-policy", choices=K_POLICIES, default="load-aware",
                   help="load-aware: pick k each round, up to -k, from measured call costs; fixed: always -k "
                        "(default: load-aware)")
    p.add_argument("--tree-width", type=_positive_int, default=1,
                   help="tokens tried at each depth of a draft tree; needs a --tree target (default: 1, chains)")
    p.add_argument("--tree-nodes", type=_positive_int,
                   help="most tree nodes a round (default: k x tree-width; suffix and medusa: 16)")
    p.add_argument("--threads", type=_positive_int, help="threads an engine call uses (default: all cores)")
    p.add_argument("--datastore", metavar="INDEX",
                   help="an index (`trtspec index`) suffix decoding also drafts from (default: none)")


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
    _add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--chat", action="store_true",
                   help="treat each prompt as a user message in the model's chat template; print only the answer")
    p.add_argument("--system", help="with --chat: the system message (default: the template's own, if any)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="most tokens generated a prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default: no limit)")
    p.add_argument("--top-p", type=float, help="sample within this probability mass (default: 1, no limit)")
    p.add_argument("--seed", type=int, help="random seed of a sampled run (default: a fresh one)")
    p.add_argument("--stop", action="append", help="stop string; repeatable (default: none)")
    p.add_argument("--backend", choices=["auto", "torch"], default="auto",
                   help="auto: run the engines the directories hold; torch: compile model or export directories with "
                        "torch.compile")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="with --backend torch: where the compiled model runs")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="with --backend torch: the model's float type (default: an export's own, else float32)")
    printing = p.add_argument_group("printing")  # how the command shows the result; trtspec.generate returns it
    printing.add_argument("--json", action="store_true", help="print results and statistics as JSON")
    printing.add_argument("--no-stream", dest="stream", action="store_false",
                          help="print the text when it is complete (default: stream it as it is generated)")

    def run(args):
        from . import generate

        if args.system and not args.chat:
            raise SystemExit("trtspec generate: --system goes with --chat")
        if args.stream and len(args.prompt) == 1 and not args.json:
            stream = _call(generate, args, stream=True)
            sys.stdout.write("" if args.chat else args.prompt[0])
            for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            _print_stats(stream.result.stats, stream.result.finish_reason)
            return
        out = _call(generate, args, stream=False)
        if args.json:
            print(json.dumps({
                "results": [
                    {"prompt": p, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                     "stats": r.stats.to_dict()}
                    for p, r in zip(args.prompt, out)
                ],
                "stats": out.stats.to_dict(),
            }, indent=2))
            return
        for p, r in zip(args.prompt, out):
            print(f"{p}{r.text}\n---")
        _print_stats(out.stats, None)

    p.set_defaults(run=run)


def _add_bench(sub):
    p = sub.add_parser("bench", help="compare trtspec with HF generate/assisted/prompt lookup on the same prompts")
    p.add_argument("--target", required=True, help="the target's engine directory")
    p.add_argument("--draft", required=True, help="the draft's engine directory")
    p.add_argument("--hf-target", help="the target's HF directory (default: the one its engine came from)")
    p.add_argument("--hf-draft", help="the draft's HF directory (default: the one its engine came from)")
    p.add_argument("--prompts", required=True,
                   help="a JSON list of prompts (strings or {'prompt': ...}), e.g. models/heldout.json")
    p.add_argument("--num-prompts", type=_positive_int, help="use the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="most tokens generated a prompt")
    p.add_argument("--repeats", type=_positive_int, default=3, help="runs per configuration; the median is reported")
    p.add_argument("--max-k", type=_positive_int, default=8, help="measure fixed k = 1..N and load-aware k up to N")
    p.add_argument("--temperatures", type=lambda t: [float(v) for v in t.split(",")], default=(0.0, 0.8),
                   help="comma-separated temperatures to measure (default: 0,0.8)")
    p.add_argument("--threads", type=_positive_int, default=2, help="threads an engine call uses")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF baselines (the slow part)")
    p.add_argument("--no-self-draft", dest="self_draft", action="store_false",
                   help="skip the rows drafting with the target's own INT4 build")
    p.add_argument("--tree-width", type=_positive_int, default=3,
                   help="width of the tree rows (a target exported with --tree)")
    p.add_argument("--eagle3", help="an exported EAGLE-3 head for the target: adds chain and tree rows (default: none)")
    p.add_argument("--medusa", help="Medusa heads for the target: adds tree rows (default: none)")
    p.add_argument("-o", "--output", default="benchmarks/results", help="directory for bench.json, bench.md, bench.png")

    def run(args):
        from . import bench
        from .bench import markdown_table

        print(markdown_table(_call(bench, args)))

    p.set_defaults(run=run)


def _add_serve(sub):
    p = sub.add_parser("serve", help="serve the engines over OpenAI's HTTP API (completions, chat, streaming)")
    _add_engine_arguments(p)
    p.add_argument("--max-batch", type=_positive_int, help="engine rows to use (default: all the engines have)")
    p.add_argument("--max-queue", type=_positive_int, default=MAX_QUEUE,
                   help="requests that may wait beyond the free rows; more get 429")
    p.add_argument("--max-body-bytes", type=_positive_int, default=MAX_BODY_BYTES,
                   help="largest request body read, in bytes; larger ones get 413")
    p.add_argument("--prefill-chunk", type=_positive_int, default=128,
                   help="prompt tokens read a round, shared by the prompts waiting")
    p.add_argument("--prefix-cache-mb", type=float, default=256.0, help="MB of KV kept for prefix reuse (0: off)")
    p.add_argument("--system-prompt", action="append",
                   help="text whose KV is computed at start and kept for reuse; repeatable (default: none)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on every route but /health (default: "
                                        f"${API_KEY_ENV}, else none)")
    keys.add_argument("--api-key-file", help="read accepted API keys from this file, one a line, # comments "
                                             "(default: none)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--parse-special-tokens", action="store_true",
                   help="let completions prompts spell special tokens (by default they are text)")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                   help="seconds a connection may take to send its headers before it is closed (not with --ray)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the target directory's name)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish after SIGTERM (not with --ray)")
    p.add_argument("--log-prompts", action="store_true", help="log prompt text with each request")
    ray = p.add_argument_group("Ray Serve (pip install 'trtspec[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve as a Ray Serve application: engine replicas behind one endpoint")
    ray.add_argument("--replicas", type=_positive_int, default=1, help="engine replicas")
    ray.add_argument("--autoscale", metavar="MIN:MAX",
                     help="autoscale between MIN and MAX replicas on ongoing requests (default: off, --replicas)")
    ray.add_argument("--ray-address", help="join this Ray cluster, e.g. auto or HEAD_IP:6379 (default: a local one)")
    ray.add_argument("--router", choices=["prefix", "pow2"], default="prefix",
                     help="prefix: to the replica holding the prompt's prefix unless overloaded; pow2: Ray's "
                          "power of two choices")
    ray.add_argument("--ray-metrics-port", type=int,
                     help="port of a local Ray's Prometheus endpoint (default: Ray picks)")
    ray.add_argument("--direct-ingress", action="store_true",
                     help="the ingress replica listens on --port itself, without Ray's HTTP proxy")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each replica reserves")

    def run(args):
        from . import serve

        try:
            _call(serve, args)
        except ImportError as exc:  # --ray without Ray Serve, an optional extra: the message says how to install it
            raise SystemExit(f"trtspec serve: {exc}") from None

    p.set_defaults(run=run)


def _add_bench_serve(sub):
    p = sub.add_parser("bench-serve", help="load-test any OpenAI-compatible server: throughput, TTFT, inter-token latency")
    p.add_argument("--url", required=True, help="the server's base URL (e.g. http://127.0.0.1:8000/v1)")
    p.add_argument("--model", help="model name to send (default: the first of the server's /v1/models)")
    p.add_argument("--prompts", default="models/heldout.json", help="JSON prompts file, as for `trtspec bench`")
    p.add_argument("--max-tokens", type=_positive_int, default=128, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0, help="temperature of each request")
    p.add_argument("--concurrency", type=_positive_int, nargs="*", default=(1, 2, 4, 8, 16),
                   help="closed-loop client counts (default: 1 2 4 8 16)")
    p.add_argument("--rates", type=float, nargs="*", default=(),
                   help="open-loop Poisson arrival rates, requests/s (default: none)")
    p.add_argument("--requests", type=_positive_int, default=32, help="requests per load level")
    p.add_argument("--api-key", help="API key to send (default: none)")
    p.add_argument("--json", dest="json_out", help="also write the results to this JSON file (default: no file)")

    def run(args):
        from . import bench_serve

        _call(bench_serve, args)

    p.set_defaults(run=run)


def _add_distill(sub):
    p = sub.add_parser("distill", help="train a small draft for a target by distillation (HF dir -> HF dir)",
                       description="Train a draft model (or an EAGLE-3 / Medusa head) that mimics the target's "
                       "next-token distribution on your text. Writes an HF model directory with the target's tokenizer "
                       "and distill_report.json. Run the same command again to resume a stopped run.")
    p.add_argument("--target", required=True,
                   help="the target's HF model directory (draft: or a GGUF file; eagle3: or its built engine, "
                        "which writes its own data)")
    p.add_argument("--out", required=True, help="new (or empty) directory for the draft")
    p.add_argument("--method", choices=["draft", "eagle3", "medusa"], default="draft",
                   help="draft: a small model of the target's family; eagle3: an EAGLE-3 head; medusa: Medusa heads")
    p.add_argument("--draft-vocab", type=_positive_int,
                   help="eagle3/medusa: size of the head's vocabulary (default: 2048 eagle3, 1024 medusa)")
    p.add_argument("--ttt-steps", type=_positive_int,
                   help="eagle3: training-time test steps (drafted positions trained a window; default: 3, from an "
                        "engine 4)")
    p.add_argument("--medusa-heads", type=_positive_int, default=4, help="medusa: number of heads")
    p.add_argument("--data", nargs="+",
                   help="text files, or directories searched for --pattern (default: none; required but with an "
                        "engine --target, which writes its own)")
    p.add_argument("--heldout", nargs="+", help="held-out files or directories (default: 1 in 20 of --data's files)")
    p.add_argument("--pattern", default="*.py", help="file pattern in data directories")
    own = p.add_argument_group("eagle3 from a built engine: the engine answers requests and trains on its answers")
    own.add_argument("--prompts", default="humaneval,chat,docstring,completion,text",
                     help="request sources, comma-separated (docs/distilling.md)")
    own.add_argument("--text", help="a plain-text file for the text source, e.g. botchan.txt (default: none, the "
                                    "text source left out)")
    own.add_argument("--stdlib", help="a Python source tree for the docstring and completion sources (default: this Python's "
                                      "standard library)")
    own.add_argument("--data-dir", help="where the engine's answers are kept, resumable (default: OUT/.distill/data, "
                                        "removed when the head is written)")
    own.add_argument("--data-tokens", type=int,
                     help="new tokens the engine may write this run (default: answer every request; 0: train on "
                          "what --data-dir holds)")
    own.add_argument("--samples", type=int, default=0, help="sampled answers per request besides the greedy one")
    own.add_argument("--max-new-tokens", type=_positive_int, default=256, help="longest answer")
    own.add_argument("--coverage", type=float, default=0.97,
                     help="the head's vocabulary covers this share of the answers' tokens (default: 0.97; "
                          "--draft-vocab: a size)")
    own.add_argument("--device", default="cpu", help="where the head trains: cpu or cuda")
    own.add_argument("--init", help="an EAGLE-3 head to train on: its weights, shape and vocabulary (default: none, "
                                    "a new head)")
    own.add_argument("--eval-every", type=int, default=500,
                     help="steps between held-out acceptance checks through the engines (at checkpoints; 0: at the "
                          "end only)")
    shape = p.add_argument_group("draft shape (defaults: half the target's hidden size, a third of its layers)")
    shape.add_argument("--layers", type=_positive_int, help="decoder layers (default: a third of the target's)")
    shape.add_argument("--hidden", type=_positive_int, help="hidden size (default: half the target's)")
    shape.add_argument("--heads", type=_positive_int, help="attention heads (default: fitted to --hidden)")
    shape.add_argument("--kv-heads", type=_positive_int, help="key/value heads (default: fitted to --heads)")
    shape.add_argument("--intermediate", type=_positive_int, help="MLP size (default: fitted to --hidden)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=_positive_int, help="optimiser steps, deterministic (default: 1000)")
    budget.add_argument("--minutes", type=float, help="a wall-clock budget instead of --steps (default: none)")
    p.add_argument("--batch", type=_positive_int, help="windows a step (default: 16; heads 8)")
    p.add_argument("--seq", type=_positive_int, default=256, help="tokens a training window")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 3e-3; heads 2e-3)")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    p.add_argument("--kd-weight", type=float, default=1.0,
                   help="weight of the KL term; the rest is cross-entropy on the text (0: no distillation)")
    p.add_argument("--sampled-fraction", type=float, default=0.0,
                   help="fraction of each batch made of the target's own sampled continuations")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="stored dtype (default: the target's)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="train in float32 even where the CPU has AVX512-BF16")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the acceptance check (0: skip)")
    p.add_argument("--eval-k", type=_positive_int, default=4, help="draft tokens a round in that check")
    p.add_argument("--eval-tokens", type=_positive_int, default=64, help="new tokens a prompt in that check")
    p.add_argument("--checkpoint-every", type=_positive_int, default=50,
                   help="optimiser steps between checkpoints, from which a rerun resumes")
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: all cores)")

    def run(args):
        from . import distill

        _call(distill, args)

    p.set_defaults(run=run)


def _print_stats(stats, finish_reason):
    line = (
        f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, first token after "
        f"{stats.time_to_first_token_s * 1000:.1f} ms, {stats.target_calls} target calls"
    )
    if stats.proposed:
        line += (
            f", acceptance {stats.acceptance_rate:.2f}, {stats.mean_tokens_per_target_call:.2f} tokens/target call, "
            f"accepted per round {stats.accepted_histogram}"
        )
    if finish_reason:
        line += f", finish: {finish_reason}"
    print(line + "]", file=sys.stderr)


# Third-party loggers that narrate their own work (graph optimiser passes, exporter registrations): shown with -v.
CHATTY_LOGGERS = ("torch.onnx", "torch._dynamo", "torch.export", "onnxscript", "onnx_ir", "transformers", "huggingface_hub")


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each message (a redirect or a test's capture set later), not as it was
    when logging was configured: a handler holding a replaced, closed stream fails on every message."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _configure_logging(verbose: bool) -> None:
    """trtspec's own progress at INFO; everything else only from WARNING, and the chatty ones only with -v."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("trtspec: %(message)s" if not verbose else "%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger("trtspec").setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        except ImportError:
            pass


class _Reference(argparse.HelpFormatter):
    """Help as a reference: an option with a value ends with its default, unless its help already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))
        if (action.option_strings and not flag and not action.required and action.default is not None
                and action.default is not argparse.SUPPRESS and "default" not in text):
            value = action.default
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            text += f" (default: {shown})"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The `trtspec` argument parser, every subcommand included (parsing runs nothing)."""
    parser = argparse.ArgumentParser(
        prog="trtspec", formatter_class=_Reference,
        description="Export, quantize and build a causal LM's engines, and run lossless speculative decoding.",
        epilog="`trtspec COMMAND --help` lists a command's options. Docs: docs/README.md in the repository.")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show other libraries' logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_Reference))
    _add_export(sub)
    _add_export_head(sub)
    _add_quantize(sub)
    _add_check(sub)
    _add_build(sub)
    _add_index(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_bench_serve(sub)
    _add_distill(sub)
    return parser


def main(argv=None) -> int:
    from .errors import TrtspecError

    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        return args.run(args) or 0
    except (TrtspecError, ValueError) as e:
        print(f"trtspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
