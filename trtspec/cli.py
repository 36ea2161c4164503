"""The `trtspec` command: export, build, generate."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _add_export(sub):
    p = sub.add_parser("export", help="HF model directory -> step graph artifact (ONNX + manifest + tokenizer)")
    p.add_argument("model_dir", help="a Hugging Face model directory (config.json, weights, tokenizer)")
    p.add_argument("-o", "--output", required=True, help="artifact directory to write, e.g. export/NAME")
    p.add_argument("--max-seq-len", type=_positive_int, default=512, help="KV cache capacity S_max (default 512)")
    p.add_argument("--max-batch", type=_positive_int, default=4, help="largest batch the engine serves (default 4)")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")

    def run(args):
        from .exporter import export

        out = export(args.model_dir, args.output, max_seq_len=args.max_seq_len, max_batch=args.max_batch, dtype=args.dtype)
        print(out)

    p.set_defaults(run=run)


def _add_build(sub):
    p = sub.add_parser("build", help="step graph artifact -> engine artifact for a backend")
    p.add_argument("export_dir")
    p.add_argument("-o", "--output", required=True, help="engine directory to write, e.g. engines/NAME")
    p.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default="onnxruntime")

    def run(args):
        from .builder import build

        print(build(args.export_dir, args.output, backend=args.backend))

    p.set_defaults(run=run)


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
    p.add_argument("--target", required=True, help="engine (or export) directory of the target model")
    p.add_argument("--draft", help="engine (or export) directory of the draft model")
    p.add_argument("--drafter", choices=["draft", "prompt_lookup", "none"], help="default: draft if --draft, else none")
    p.add_argument("-k", "--num-draft-tokens", type=_positive_int, default=4, help="tokens drafted per round (default 4)")
    p.add_argument("--adaptive-k", action="store_true", help="choose k each round, up to -k, from measured costs")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string; repeatable")
    p.add_argument("--threads", type=_positive_int, help="onnxruntime intra-op threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print results and statistics as JSON")

    def run(args):
        from .runtime import Generator

        gen = Generator(
            args.target,
            args.draft,
            num_draft_tokens=args.num_draft_tokens,
            drafter=args.drafter,
            adaptive_k=args.adaptive_k,
            num_threads=args.threads,
        )
        options = dict(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
        )
        if len(args.prompt) == 1 and not args.json:
            stream = gen.stream(args.prompt[0], **options)
            sys.stdout.write(args.prompt[0])
            for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            _print_stats(stream.result.stats, stream.result.finish_reason)
            return
        out = gen.generate(args.prompt, **options)
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


def main(argv=None) -> int:
    from .errors import TrtspecError

    parser = argparse.ArgumentParser(prog="trtspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_export(sub)
    _add_build(sub)
    _add_generate(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="trtspec: %(message)s")
    try:
        args.run(args)
    except (TrtspecError, ValueError) as e:
        print(f"trtspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
