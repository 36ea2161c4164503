"""Write the two held-out text sets shipped with the repository (run once; its output is committed).

Both come from the CPython stdlib files the bundled pair never trained on
(models/heldout.json): the even-numbered held-out files give the default
calibration text (trtspec/quantization/calibration.json), the odd-numbered
ones the perplexity text of benchmarks/bench_quant.py (benchmarks/data/eval_text.json),
so no quantization mode is scored on the text it was calibrated on.

    python benchmarks/make_text_sets.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from train_pair import read, stdlib_files

ROOT = Path(__file__).resolve().parent.parent
CHUNK_CHARS = 1000


def chunks(text: str) -> list[str]:
    """Consecutive pieces of about CHUNK_CHARS characters, cut at line ends; short tails dropped."""
    out, acc = [], ""
    for line in text.splitlines(keepends=True):
        acc += line
        if len(acc) >= CHUNK_CHARS:
            out.append(acc)
            acc = ""
    return [c for c in out if len(c.strip()) > 300]


def round_robin(files: list[Path], n: int) -> list[str]:
    """n chunks taken one per file in turn, so every file contributes."""
    per_file = [chunks(read(p)) for p in files]
    picked, depth = [], 0
    while len(picked) < n and any(depth < len(c) for c in per_file):
        picked += [c[depth] for c in per_file if depth < len(c)]
        depth += 1
    return picked[:n]


def main() -> int:
    _, held, root = stdlib_files()
    recorded = json.loads((ROOT / "models" / "heldout.json").read_text())["files"]
    if [p.relative_to(root).as_posix() for p in held] != recorded:
        print("this Python's stdlib is not the one the bundled pair was trained on; the held-out split differs",
              file=sys.stderr)
        return 1
    sets = {
        ROOT / "trtspec" / "quantization" / "calibration.json": (held[0::2], 128),
        ROOT / "benchmarks" / "data" / "eval_text.json": (held[1::2], 96),
    }
    for path, (files, n) in sets.items():
        texts = round_robin(files, n)
        payload = {"source": "CPython 3.11 stdlib files held out from the bundled pair's training",
                   "files": [p.relative_to(root).as_posix() for p in files], "texts": texts}
        path.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"{path.relative_to(ROOT)}: {len(texts)} texts, {sum(map(len, texts))} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
