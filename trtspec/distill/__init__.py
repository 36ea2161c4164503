"""Training drafts for a target: one package for every method, one measurement of them all.

  draft.py       a small draft model of the target's family, distilled on text; ``distill()``, every method's entry
  heads.py       EAGLE-3 and Medusa heads on the target's features (their model code and files: heads/)
  prompts.py     requests built from the registry's data (HumanEval, chatterbot-corpus, docstrings, a text), and
                 the held-out set the benchmarks measure on
  data.py        a built engine's own answers to them, with its features and next-token distributions, in shards
  eagle3_engine.py  an EAGLE-3 head trained on those stored answers (`distill --method eagle3 --target ENGINE`)
  acceptance.py  measure_acceptance: the trained draft drafting for its target through trtspec engines

The runtime imports nothing from here (tests/test_imports.py): the drafts run from runtime/drafters/.
"""

from __future__ import annotations

from .acceptance import measure_acceptance
from .draft import METHODS, distill, draft_config, heldout_metrics, sample_continuations

__all__ = ["METHODS", "distill", "draft_config", "heldout_metrics", "measure_acceptance", "sample_continuations"]
