"""Copy a trained head directory, its float weights stored in float16 (what the bundled heads ship as)."""

from __future__ import annotations

import shutil
from pathlib import Path


def store_half(src, dst) -> Path:
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    # (no tokenizer copy: a head uses its target's)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".distill", "distill_report.json", "tokenizer"))
    for f in dst.glob("*.safetensors"):
        state = load_file(str(f))
        save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, str(f))
    return dst
