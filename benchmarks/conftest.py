"""pytest-benchmark suite over the bundled trained pair: `make bench` (not part of `make test`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def pair():
    """Engines for models/stdlib-target and models/stdlib-draft (exported and built on first use)."""
    from trtspec import build, export

    engines = {}
    for name in ("stdlib-target", "stdlib-draft"):
        engine = ROOT / "engines" / name
        if not (engine / "manifest.json").is_file():
            export(ROOT / "models" / name, ROOT / "export" / name, max_seq_len=512, max_batch=4)
            build(ROOT / "export" / name, engine)
        engines[name] = engine
    return engines["stdlib-target"], engines["stdlib-draft"]


@pytest.fixture(scope="session")
def prompts():
    data = json.loads((ROOT / "models" / "heldout.json").read_text())
    return [p["prompt"] for p in data["prompts"]][:6]
