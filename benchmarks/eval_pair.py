"""What the bundled pair writes: repetition and syntax of greedy continuations of the held-out prompts.

    python benchmarks/eval_pair.py                                   # the committed pair, models/
    python benchmarks/eval_pair.py --pair old=path/to/models --pair new=models

For every pair (a directory holding stdlib-target, stdlib-draft and heldout.json) and each of its two models:
greedy continuations of `max_new_tokens` (128) for the held-out prompts (HF `generate()`, the reference for
what a model writes; trtspec's greedy output is identical to it), then

- repeated lines: of the continuation's complete, non-blank lines, the share whose text (leading and trailing
  whitespace stripped) equals a line generated earlier in the same continuation, over all prompts;
- parses: the continuation cut at its last complete line (the whole of it if the model ended the file), placed
  after its prompt's own context (the held-out file's text up to and including the prompt), must pass
  `ast.parse`. Strictly, a cut that ends in an open block, bracket or string fails even if every line so far is
  valid, and so does the files' own text about half the time (the reference column). So the second check is
  the one that says whether the model wrote valid Python: `ast.parse` in the compiler's incomplete-input mode
  (`PyCF_ALLOW_INCOMPLETE_INPUT`, what the interactive interpreter uses), which passes code that is valid so
  far and only needs more lines ("incomplete input"), and fails every other syntax error.
  Both checks on the file's true continuation (as many lines as the model wrote) are the reference.

The held-out prompts are whole lines without the last one's newline: the byte-level BPE tokenizer writes a
newline and the next line's indentation as one token, so a prompt ending in a bare newline token tells the
model the next line starts at column 0 (where, mid-function, it then writes top-level comments). The model
writes the newline itself, as it did in training; `--keep-final-newline` measures the other way.

Writes benchmarks/results/pair_quality.{json,md}.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sysconfig
from pathlib import Path

from common import RESULTS, ROOT, save_results


def complete_lines(text: str, finished: bool) -> str:
    """The text up to its last complete line (all of it if the model ended the file)."""
    if finished or text.endswith("\n"):
        return text
    cut = text.rfind("\n")
    return text[: cut + 1] if cut >= 0 else ""


def repeated_lines(text: str) -> tuple[int, int]:
    """(repeats, lines): non-blank lines equal, stripped, to an earlier line of the same text."""
    seen, repeats, lines = set(), 0, 0
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        lines += 1
        repeats += s in seen
        seen.add(s)
    return repeats, lines


INCOMPLETE_INPUT = 0x4000  # PyCF_ALLOW_INCOMPLETE_INPUT (CPython >= 3.11; what codeop uses)


def parses(source: str, prefix: bool = False) -> bool:
    """ast.parse succeeds; with ``prefix``, also when the only error is that the source needs more lines."""
    try:
        compile(source, "<continuation>", "exec", ast.PyCF_ONLY_AST | (INCOMPLETE_INPUT if prefix else 0))
    except SyntaxError as e:
        return prefix and e.msg == "incomplete input"
    except ValueError:
        return False
    return True


def continuations(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[tuple[str, bool]]:
    """Greedy continuations (text, ended with EOS) of each prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1] :].tolist()
        finished = tok.eos_token_id in gen
        if finished:
            gen = gen[: gen.index(tok.eos_token_id)]
        out.append((tok.decode(gen), finished))
    return out


def evaluate(texts: list[tuple[str, bool]], contexts: list[str]) -> dict:
    rep = [repeated_lines(complete_lines(t, f)) for t, f in texts]
    ok = [parses(ctx + complete_lines(t, f)) for (t, f), ctx in zip(texts, contexts)]
    valid = [parses(ctx + complete_lines(t, f), prefix=True) for (t, f), ctx in zip(texts, contexts)]
    return {"repeated_line_rate": sum(r for r, _ in rep) / max(1, sum(n for _, n in rep)),
            "lines": sum(n for _, n in rep), "parse_rate": sum(ok) / len(ok), "parsed": sum(ok),
            "valid_prefix_rate": sum(valid) / len(valid), "valid_prefix": sum(valid),
            "continuations": len(ok), "median_lines": statistics.median(n for _, n in rep)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", action="append", default=None, metavar="NAME=DIR",
                    help="a directory with stdlib-target, stdlib-draft and heldout.json (default: new=models)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--keep-final-newline", action="store_true",
                    help="end each prompt with its last line's newline (default: the model writes it)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pairs = [p.split("=", 1) for p in (args.pair or [f"new={ROOT / 'models'}"])]
    res = {"settings": {**vars(args), "stdlib": str(stdlib)}, "pairs": {}}
    for name, d in pairs:
        d = Path(d)
        held = json.loads((d / "heldout.json").read_text())["prompts"]
        # a held-out prompt is whole lines; its final newline is left to the model (see the module docstring;
        # prompts files written before that carried it)
        prompts = [p["prompt"].removesuffix("\n") + ("\n" if args.keep_final_newline else "") for p in held]
        contexts, truths = [], []
        for p, prompt in zip(held, prompts):
            text = (stdlib / p["file"]).read_text(encoding="utf-8", errors="replace")
            end = text.index(p["prompt"]) + len(prompt)
            contexts.append(text[:end])
            truths.append(text[end:])
        row = {}
        for model in ("stdlib-target", "stdlib-draft"):
            texts = continuations(d / model, prompts, args.max_new_tokens)
            row[model] = evaluate(texts, contexts)
            row[model]["examples"] = [t for t, _ in texts[:3]]
            # the file's own continuation, as many complete lines as the model wrote: the check's ceiling
            ref = []
            for (t, f), truth in zip(texts, truths):
                n = complete_lines(t, f).count("\n")
                ref.append(("".join(truth.splitlines(keepends=True)[:n]), True))
            reference = evaluate(ref, contexts)
            r = row[model]
            r["reference_parse_rate"], r["reference_valid_prefix_rate"] = reference["parse_rate"], reference["valid_prefix_rate"]
            print(f"{name} {model}: repeated lines {r['repeated_line_rate']:.1%} of {r['lines']}, "
                  f"parses {r['parsed']}/{r['continuations']}, valid so far {r['valid_prefix']}/{r['continuations']} "
                  f"(the files' own text: {r['reference_parse_rate']:.0%}, {r['reference_valid_prefix_rate']:.0%})",
                  flush=True)
        res["pairs"][name] = row
    lines = ["| pair | model | repeated lines | parse (ast.parse) | valid so far (incomplete-input mode) "
             "| the files' own text, same lines: parse / valid so far |", "|---|---|---|---|---|---|"]
    for name, row in res["pairs"].items():
        for model, r in row.items():
            lines.append(f"| {name} | {model} | {r['repeated_line_rate']:.1%} ({r['lines']} lines) | "
                         f"{r['parsed']}/{r['continuations']} ({r['parse_rate']:.0%}) | "
                         f"{r['valid_prefix']}/{r['continuations']} ({r['valid_prefix_rate']:.0%}) | "
                         f"{r['reference_parse_rate']:.0%} / {r['reference_valid_prefix_rate']:.0%} |")
    save_results(RESULTS / "pair_quality", res, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
