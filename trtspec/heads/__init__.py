"""Draft heads on the target's own features: EAGLE-3 (heads/eagle3.py) and Medusa (heads/medusa.py)."""

from __future__ import annotations

from ..runtime.drafters.eagle3 import feature_columns

__all__ = ["feature_columns"]
