"""Training drafts for a target: one package for every method, one measurement of them all.

  draft.py       a small draft model of the target's family, distilled on text; ``distill()``, every method's entry
  heads.py       EAGLE-3 and Medusa heads on the target's features (their model code and files: heads/)
  acceptance.py  measure_acceptance: the trained draft drafting for its target through trtspec engines

The runtime imports nothing from here (tests/test_imports.py): the drafts run from runtime/drafters/.
"""

from __future__ import annotations

from .acceptance import measure_acceptance
from .draft import METHODS, distill, draft_config, heldout_metrics, sample_continuations

__all__ = ["METHODS", "distill", "draft_config", "heldout_metrics", "measure_acceptance", "sample_continuations"]
