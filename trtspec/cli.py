"""The `trtspec` command: export, quantize, check, build, generate, bench, serve, distill.

Each command calls the function of its name in `trtspec` with its options, whose names are the function's
parameters (tests/test_api.py); a command only parses its arguments and prints what the function returns.
"""

from __future__ import annotations

import argparse
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
    p = sub.add_parser("export", help="HF model directory or GGUF file -> step graph artifact (ONNX + manifest + tokenizer)")
    p.add_argument("model_dir", help="a Hugging Face model directory (config.json, weights, tokenizer), or a GGUF file "
                                     "(or a directory holding one): its tokenizer and chat template come from the file, "
                                     "and its Q4_0/Q4_1/Q4_K/Q8_0 blocks are kept for `build`")
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="artifact directory to write, e.g. export/NAME")
    p.add_argument("--max-seq-len", type=_positive_int, default=512, help="KV cache capacity S_max (default 512)")
    p.add_argument("--max-batch", type=_positive_int, default=4, help="largest batch the engine serves (default 4)")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    p.add_argument("--max-call-tokens", type=_positive_int, default=None,
                   help="tokens one call may carry where sliding-window layers keep a ring buffer of window + N - 1 "
                        "slots (default 128; prompts are read in chunks of at most N)")
    p.add_argument("--no-ring-cache", dest="ring_cache", action="store_false",
                   help="full-size caches for sliding-window layers too (TensorRT: its KV cache update has no "
                        "circular mode)")
    p.add_argument("--tree", action="store_true",
                   help="a tree_mask input: one call verifies a token tree (the target of --tree-width > 1)")
    p.add_argument("--hidden-states", metavar="LAYERS",
                   help="a hidden_states output for draft heads: low,mid,high (EAGLE-3), last (Medusa) or HF "
                        "hidden_states indices")

    def run(args):
        from . import export

        print(_call(export, args))

    p.set_defaults(run=run)


def _add_export_head(sub):
    p = sub.add_parser("export-head", help="EAGLE-3 head directory -> its step graph artifact, for a target")
    p.add_argument("head_dir", help="an EAGLE-3 head (trtspec distill --method eagle3, or the EAGLE authors' layout)")
    p.add_argument("--target", required=True, help="the target's export or engine, made with --hidden-states")
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="artifact directory to write")
    p.add_argument("--target-model", help="the target's HF directory, for a head without its own embedding "
                                          "(default: the one the target was exported from)")
    p.add_argument("--max-seq-len", type=_positive_int, help="the head's KV cache capacity (default: the target's)")
    p.add_argument("--max-batch", type=_positive_int, help="largest batch the head serves (default: the target's)")

    def run(args):
        from . import export_head

        print(_call(export_head, args))

    p.set_defaults(run=run)


def _add_quantize(sub):
    from .quantization.quantize import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, DEFAULT_CALIB_SAMPLES, MODES

    p = sub.add_parser("quantize", help="step graph artifact -> the same graph with INT8/FP8/INT4 Q/DQ (TensorRT's explicit form)")
    p.add_argument("export_dir", help="an unquantized export artifact, e.g. export/NAME")
    p.add_argument("-o", "--output", dest="out_dir", required=True,
                   help="artifact directory to write, e.g. export/NAME-int4-awq")
    p.add_argument("--mode", required=True, choices=list(MODES),
                   help="int8-wo: INT8 weights per channel; int8-sq: W8A8 with SmoothQuant; fp8: FP8 E4M3 weights and "
                        "activations; int4-rtn / int4-awq / int4-gptq: INT4 weights blocked along K, round-to-nearest "
                        "/ AWQ / GPTQ")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, help=f"INT4 block along K (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--calib-file", help="calibration text: plain text, .json list of strings, or .jsonl "
                                        "(default: held-out text shipped with trtspec)")
    p.add_argument("--calib-samples", type=_positive_int,
                   help=f"windows of up to 256 tokens to calibrate on (default {DEFAULT_CALIB_SAMPLES})")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the lm_head too; tied to the embedding (int4 modes), one INT4 copy serves both "
                        "(default: keep it in high precision)")
    p.add_argument("--no-act-order", dest="act_order", action="store_false", default=None,
                   help="int4-gptq: quantize input channels in order instead of by decreasing activation energy")

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
    p.add_argument("export_dir")

    def run(args):
        from . import check
        from .builder.tensorrt_check import format_report

        problems = _call(check, args)
        print(format_report(args.export_dir, problems))
        return 1 if problems else 0

    p.set_defaults(run=run)


def _add_build(sub):
    p = sub.add_parser("build", help="step graph artifact -> engine artifact for a backend")
    p.add_argument("export_dir", help="an export artifact (export/NAME); --backend torch also takes the model itself, "
                                      "an HF model directory or a GGUF file, and needs no export")
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="engine directory to write, e.g. engines/NAME")
    p.add_argument("--backend", choices=["onnxruntime", "tensorrt", "torch"],
                   help="torch: the step module compiled ahead of time by AOTInductor into one package (for an export "
                        "of a GGUF file, its linear layers on trtspec's own GGUF kernels). Default: torch for a GGUF "
                        "file, an HF directory or an export of a GGUF file (where the kernels compile, and unless "
                        "--weights float or an onnxruntime option is given), onnxruntime for any other export")
    ort_group = p.add_argument_group("onnxruntime only")
    gguf_group = p.add_argument_group("an export of a GGUF file (onnxruntime and torch)")
    ort_group.add_argument("--no-qdq-fusion", dest="fuse_qdq", action="store_false", default=None,
                           help="run a quantized graph's Q/DQ nodes as written instead of onnxruntime's quantized kernels")
    gguf_group.add_argument("--weights", choices=["gguf", "float"],
                           help="an export of a GGUF file: gguf (default) runs the file's own 4/8-bit blocks (Q4_0, "
                                "Q4_1, Q4_K, Q8_0; other types are quantized to 4 bits here; --backend torch: every "
                                "type trtspec's kernels take, Q4_0 to Q8_0 and Q4_K to Q6_K), float the dequantized "
                                "float32 graph")
    gguf_group.add_argument("--int8-activations", action="store_true",
                           help="with --weights gguf: the 4-bit layers compute with int8-rounded activations (as "
                                "llama.cpp does), every call with 2 tokens a row or more on one graph (a one-token "
                                "call carries a pad), so each row's logits are the same in every call and speculation "
                                "reproduces the engine's own greedy output exactly; 1.16x faster decode and 1.5x "
                                "faster speculation on SmolLM2 here, further from the float weights' predictions "
                                "(benchmarks/bench_gguf_quality.py); --backend torch: the kernels' int8 variant, and "
                                "attention computed alike for every call size")
    ort_group.add_argument("--no-fusion", dest="fusion", action="store_false", default=None,
                           help="build the plain step graph, without the lowering to onnxruntime's fused kernels "
                           "(RMSNorm, RoPE, packed projections, attention over the live cache length)")
    torch_group = p.add_argument_group("torch only")
    torch_group.add_argument("--device", choices=["cpu", "cuda"],
                             help="where the torch engine runs (default cpu; cuda: float weights)")
    torch_group.add_argument("--max-seq-len", type=_positive_int,
                             help="built from the model itself: KV cache capacity per row (default 512); "
                                  "--max-batch: most rows a call (default 4)")
    trt = p.add_argument_group("tensorrt only")
    trt.add_argument("--max-prefill", type=_positive_int, help="most tokens per row in one prefill call (default: the KV cache capacity)")
    trt.add_argument("--verify-tokens", type=_int_list,
                     help="tokens per verify call, k+1 for k drafted tokens, comma-separated (default 2,3,...,9)")
    trt.add_argument("--max-batch", type=_positive_int,
                     help="most rows a call (default: the export's --max-batch; also --backend torch built from the "
                          "model itself)")
    trt.add_argument("--workspace", dest="workspace_mib", type=_positive_int, metavar="MIB",
                     help="TensorRT workspace limit in MiB (default: TensorRT's)")
    trt.add_argument("--timing-cache", metavar="PATH", help="TensorRT timing cache file: read if present, written after the build")

    def run(args):
        from . import build

        print(_call(build, args))

    p.set_defaults(run=run)


K_POLICIES = ("load-aware", "fixed")  # the scheduler's (runtime/scheduler.py), without importing it here


def _add_engine_arguments(p) -> None:
    """The engine and drafting arguments that `generate` and `serve` share."""
    p.add_argument("--target", required=True, help="engine (or export) directory of the target model")
    p.add_argument("--draft", help="engine (or export) directory of the draft model, or `self`: the target's own "
                                   "INT4 build (made once from its export, beside the target engine)")
    p.add_argument("--drafter", choices=["draft", "eagle3", "medusa", "prompt_lookup", "suffix", "none"],
                   help="default: draft if --draft, else none; eagle3/medusa: --draft is the exported head; suffix: "
                        "no model, trees from the request's own text and earlier outputs (a --tree target) or chains, "
                        "shaped each round from the measured call costs; with --draft, the draft model drafts the "
                        "rows suffix matching has nothing for")
    p.add_argument("-k", "--num-draft-tokens", type=_positive_int, default=4,
                   help="most tokens drafted per round (default 4); with --k-policy load-aware fewer, down to 0, "
                        "when drafting does not pay")
    p.add_argument("--k-policy", choices=K_POLICIES, default="load-aware",
                   help="load-aware (default): choose k each round, up to -k, from the measured costs at the current "
                        "batch size; fixed: draft -k tokens every round")
    p.add_argument("--tree-width", type=_positive_int, default=1,
                   help="draft a tree: beside each drafted token its next likeliest tree-width - 1, verified in one "
                        "target call (the target exported with --tree; default 1: chains)")
    p.add_argument("--tree-nodes", type=_positive_int, help="most tree nodes per round (default k x tree-width; "
                                                            "suffix and medusa: 16)")
    p.add_argument("--threads", type=_positive_int, help="onnxruntime intra-op threads (default: all cores)")


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
    _add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user's message, put in the model's chat template (an instruct model's "
                        "form); only the answer is printed")
    p.add_argument("--system", help="with --chat: the system message (default: the template's own, if any)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string; repeatable")
    p.add_argument("--backend", choices=["auto", "torch"], default="auto",
                   help="auto (default): run the engines the directories hold; torch: compile the HF model or export "
                        "directories with torch.compile (inductor, CPU)")
    printing = p.add_argument_group("printing")  # how the command shows the result; trtspec.generate returns it
    printing.add_argument("--json", action="store_true", help="print results and statistics as JSON")
    printing.add_argument("--no-stream", dest="stream", action="store_false",
                          help="print one prompt's text once it is complete (default: as it is generated)")

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
    p.add_argument("--target", required=True, help="target engine directory")
    p.add_argument("--draft", required=True, help="draft engine directory")
    p.add_argument("--hf-target", help="target HF model directory (default: the one the engine was exported from)")
    p.add_argument("--hf-draft", help="draft HF model directory (default: the one the engine was exported from)")
    p.add_argument("--prompts", required=True,
                   help="a JSON file with a list of prompts (strings, or objects with a 'prompt' key, or "
                        "{'prompts': [...]}) such as models/heldout.json")
    p.add_argument("--num-prompts", type=_positive_int, help="use the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--repeats", type=_positive_int, default=3, help="runs per configuration; the median is reported")
    p.add_argument("--max-k", type=_positive_int, default=8, help="measure fixed k = 1..max-k and load-aware k up to max-k (default 8)")
    p.add_argument("--temperatures", type=lambda t: [float(v) for v in t.split(",")], default=(0.0, 0.8))
    p.add_argument("--threads", type=_positive_int, default=2)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF baselines (they are the slow part)")
    p.add_argument("--no-self-draft", dest="self_draft", action="store_false",
                   help="skip the row drafting with the target's own INT4 build (built once beside the target)")
    p.add_argument("--tree-width", type=_positive_int, default=3,
                   help="rows drafting trees this wide (when the target was exported with --tree; default 3)")
    p.add_argument("--eagle3", help="an exported EAGLE-3 head (trtspec export-head) for the target: chain and tree rows")
    p.add_argument("--medusa", help="Medusa heads for the target (a directory): tree rows")
    p.add_argument("-o", "--output", default="benchmarks/results", help="where bench.json, bench.md, bench.png go")

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
                   help=f"requests that may wait beyond the free rows; more get 429 with Retry-After (default "
                        f"{MAX_QUEUE})")
    p.add_argument("--max-body-bytes", type=_positive_int, default=MAX_BODY_BYTES,
                   help=f"largest request body read; larger ones get 413 (default {MAX_BODY_BYTES}, 4 MiB)")
    p.add_argument("--prefill-chunk", type=_positive_int, default=128,
                   help="prompt tokens read per round (the first waiting prompt's part, then whole prompts that fit)")
    p.add_argument("--prefix-cache-mb", type=float, default=256.0, help="KV kept for prefix reuse (0: off)")
    p.add_argument("--system-prompt", action="append",
                   help="text whose KV is computed at start and pinned for reuse (e.g. a shared system prompt)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                                        f"${API_KEY_ENV} if set, else no key); visible in `ps`: prefer the "
                                        "variable or --api-key-file")
    keys.add_argument("--api-key-file", help="read the API key from this file: one key a line, any one accepted, "
                                             "lines starting with # ignored (as llama-server's --api-key-file)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--parse-special-tokens", action="store_true",
                   help="completions prompts may spell special tokens ('</s>' becomes the EOS token); by default "
                        "they are text, as chat message content always is")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                   help=f"seconds a connection may take to send a request's headers before it is closed (default "
                        f"{HEADER_TIMEOUT:.0f}; not with --ray)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the target directory's name)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight get on SIGTERM while new ones get 503; then those still "
                        "running end with an error event (default 30; not with --ray: Ray Serve drains itself)")
    p.add_argument("--log-prompts", action="store_true", help="log prompt text with each request (off by default)")
    ray = p.add_argument_group("Ray Serve (pip install 'trtspec[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve as a Ray Serve application: engine replicas behind one endpoint")
    ray.add_argument("--replicas", type=_positive_int, default=1, help="engine replicas (default 1)")
    ray.add_argument("--autoscale", metavar="MIN:MAX",
                     help="autoscale between MIN and MAX replicas on ongoing requests (instead of --replicas)")
    ray.add_argument("--ray-address", help="join this Ray cluster (e.g. auto, or HEAD_IP:6379); default: start a local one")
    ray.add_argument("--router", choices=["prefix", "pow2"], default="prefix",
                     help="prefix: to the replica holding the prompt's prefix unless overloaded (default); "
                          "pow2: Ray's power of two choices")
    ray.add_argument("--ray-metrics-port", type=int,
                     help="a local Ray's Prometheus endpoint (replica and Ray Serve metrics); default: Ray picks")
    ray.add_argument("--direct-ingress", action="store_true",
                     help="the ingress replica listens on --port itself, no Ray HTTP proxy (lower latency; one "
                          "ingress replica per node)")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each replica reserves (default 0)")

    def run(args):
        from . import serve

        try:
            _call(serve, args)
        except ImportError as exc:  # --ray without Ray Serve, an optional extra: the message says how to install it
            raise SystemExit(f"trtspec serve: {exc}") from None

    p.set_defaults(run=run)


def _add_bench_serve(sub):
    p = sub.add_parser("bench-serve", help="load-test any OpenAI-compatible server: throughput, TTFT, inter-token latency")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model name to send (default: the first of the server's /v1/models)")
    p.add_argument("--prompts", default="models/heldout.json", help="JSON prompts file (as for `trtspec bench`)")
    p.add_argument("--max-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=_positive_int, nargs="*", default=(1, 2, 4, 8, 16),
                   help="closed-loop client counts (default 1 2 4 8 16)")
    p.add_argument("--rates", type=float, nargs="*", default=(), help="open-loop Poisson arrival rates, requests/s")
    p.add_argument("--requests", type=_positive_int, default=32, help="requests per load level (default 32)")
    p.add_argument("--api-key")
    p.add_argument("--json", dest="json_out", help="write the results to this JSON file")

    def run(args):
        from . import bench_serve

        _call(bench_serve, args)

    p.set_defaults(run=run)


def _add_distill(sub):
    p = sub.add_parser("distill", help="train a small draft for a target by distillation (HF dir -> HF dir)",
                       description="Train a draft model that mimics the target's next-token distribution on your "
                       "text. Writes an HF model directory with the target's tokenizer and distill_report.json "
                       "(loss curve, held-out KL, acceptance alpha at k=4 measured through trtspec engines). "
                       "Run the same command again to resume a stopped run.")
    p.add_argument("--target", required=True, help="the target's Hugging Face model directory")
    p.add_argument("--out", required=True, help="new (or empty) directory for the draft")
    p.add_argument("--method", choices=["draft", "eagle3", "medusa"], default="draft",
                   help="draft (default): a small model of the target's family; eagle3: an EAGLE-3 head on the "
                        "target's low/mid/high features; medusa: Medusa heads on its last hidden state")
    p.add_argument("--draft-vocab", type=_positive_int,
                   help="eagle3/medusa: the head's vocabulary, the text's most frequent tokens (default 2048 / 1024)")
    p.add_argument("--ttt-steps", type=_positive_int, default=3,
                   help="eagle3: training-time test steps (drafted positions trained per window, default 3)")
    p.add_argument("--medusa-heads", type=_positive_int, default=4, help="medusa: heads (default 4)")
    p.add_argument("--data", required=True, nargs="+", help="text files, or directories searched for --pattern")
    p.add_argument("--heldout", nargs="+", help="held-out files or directories (default: files whose path "
                   "hashes to 0 mod 20 are held out of --data)")
    p.add_argument("--pattern", default="*.py", help="file pattern in data directories (default *.py)")
    shape = p.add_argument_group("draft shape (defaults: half the target's hidden size, a third of its layers)")
    shape.add_argument("--layers", type=_positive_int)
    shape.add_argument("--hidden", type=_positive_int)
    shape.add_argument("--heads", type=_positive_int)
    shape.add_argument("--kv-heads", type=_positive_int)
    shape.add_argument("--intermediate", type=_positive_int, help="MLP size")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=_positive_int, help="optimiser steps (default 1000; deterministic)")
    budget.add_argument("--minutes", type=float, help="wall-clock budget instead of --steps")
    p.add_argument("--batch", type=_positive_int, help="windows per step (default 16; heads 8)")
    p.add_argument("--seq", type=_positive_int, default=256, help="tokens per training window")
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-3; heads 2e-3)")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default 1)")
    p.add_argument("--kd-weight", type=float, default=1.0,
                   help="weight of the KL term; the rest is cross-entropy on the text (0: no distillation)")
    p.add_argument("--sampled-fraction", type=float, default=0.0,
                   help="fraction of each batch made of the target's own sampled continuations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="stored dtype (default: the target's)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="train in float32 even where the CPU has AVX512-BF16")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the acceptance check (0: skip)")
    p.add_argument("--eval-k", type=_positive_int, default=4, help="draft tokens a round in that check (default 4)")
    p.add_argument("--eval-tokens", type=_positive_int, default=64,
                   help="new tokens a prompt in that check (default 64)")
    p.add_argument("--checkpoint-every", type=_positive_int, default=50,
                   help="optimiser steps between checkpoints, from which a rerun resumes (default 50)")
    p.add_argument("--threads", type=_positive_int)

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


def build_parser() -> argparse.ArgumentParser:
    """The `trtspec` argument parser, every subcommand included (parsing runs nothing)."""
    parser = argparse.ArgumentParser(prog="trtspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_export(sub)
    _add_export_head(sub)
    _add_quantize(sub)
    _add_check(sub)
    _add_build(sub)
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
