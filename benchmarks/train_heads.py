"""Train draft heads for the bundled target on the same text as the pair (the stdlib's .py files, the same
held-out rule), offline and resumable:

    python benchmarks/train_heads.py --method eagle3 --out models/stdlib-eagle3 [--steps 1000]

The work directory (``--work``, default models/bench/heads/<method>) keeps the checkpoint: stopped, the same
command resumes. When training ends the head is written to ``--out`` (stored in float16) with its report.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def main():
    from train_pair import stdlib_files

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["eagle3", "medusa"], default="eagle3")
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the head's vocabulary, the text's most frequent tokens (default: eagle3 3072, medusa 1024)")
    args = ap.parse_args()
    work = args.work or ROOT / "models" / "bench" / "heads" / args.method
    train_files, held, _ = stdlib_files()
    common = dict(heldout=held, steps=args.steps, batch=args.batch, lr=args.lr, eval_prompts=0, threads=args.threads)
    if args.method == "eagle3":
        from trtspec.distill.heads import distill_eagle3

        report = distill_eagle3(args.target, work, train_files, draft_vocab=args.draft_vocab or 3072, intermediate=1024,
                                **common)
    else:
        from trtspec.distill.heads import distill_medusa

        report = distill_medusa(args.target, work, train_files, num_heads=4, draft_vocab=args.draft_vocab or 1024,
                                **common)
    from trtspec.heads.store import store_half

    store_half(work, args.out)
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(work)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
