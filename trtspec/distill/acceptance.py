"""How well a trained draft drafts: greedy speculative decoding through trtspec onnxruntime engines, the one
measurement every distillation method reports (distill/draft.py's draft models, distill/heads.py's heads)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path


def measure_acceptance(target_dir: Path, draft_dir: Path, prompts, *, method: str = "draft", k: int = 4,
                       max_new_tokens: int = 64, threads: int | None = None) -> dict:
    """Per-token acceptance alpha, acceptance rate and tokens per target call of ``draft_dir`` (an HF draft model,
    method "draft"; a trained head's directory, "eagle3" or "medusa") drafting for ``target_dir`` at k (Medusa: its
    16-node tree), greedy, on ``prompts``. The engines are built in a temporary directory, quietly."""
    from ..builder import build
    from ..exporter import export
    from ..heads.export import export_head
    from ..runtime import Generator

    quiet = [logging.getLogger(n) for n in ("trtspec.export", "trtspec.build")]
    levels = [q.level for q in quiet]
    with tempfile.TemporaryDirectory(prefix="trtspec-distill-") as tmp:
        tmp = Path(tmp)
        try:  # temporary engines: their export/build progress is not the user's business
            for q in quiet:
                q.setLevel(logging.WARNING)
            if method == "draft":
                target = build(export(target_dir, tmp / "target-export", max_seq_len=512, max_batch=4),
                               tmp / "target-engine", backend="onnxruntime")
                draft = build(export(draft_dir, tmp / "draft-export", max_seq_len=512, max_batch=4),
                              tmp / "draft-engine", backend="onnxruntime")
            else:
                features = "low,mid,high" if method == "eagle3" else "last"
                target = build(export(target_dir, tmp / "target-export", max_seq_len=512, max_batch=4,
                                      tree=method == "medusa", hidden_states=features), tmp / "target-engine")
                draft = export_head(draft_dir, tmp / "head", target=target) if method == "eagle3" else draft_dir
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
        options = {} if method == "draft" else {"drafter": method}
        gen = Generator(target, draft, num_draft_tokens=k, k_policy="fixed", num_threads=threads, **options)
        try:
            out = gen.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        finally:
            gen.close()
    stats = out.stats
    calls = sum(r.stats.target_calls for r in out)  # per request (a batched call serves several)
    return {"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "alpha": stats.token_acceptance,
            "acceptance_rate": stats.acceptance_rate,
            "tokens_per_target_call": stats.new_tokens / calls if calls else 0.0}
