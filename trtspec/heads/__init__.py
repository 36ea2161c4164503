"""Draft heads on the target's own features: EAGLE-3 (heads/eagle3.py) and Medusa (heads/medusa.py)."""

from __future__ import annotations

import numpy as np

from ..errors import ArtifactError


def feature_columns(model: dict, layers, hidden_size: int, what: str) -> np.ndarray:
    """The columns of a target's hidden_states output (manifest ``model`` section) that hold ``layers`` (HF
    hidden_states indices, in that order); refused, saying how to re-export, when the target lacks one."""
    have = (model.get("hidden_states") or {}).get("layers") or []
    missing = [i for i in layers if i not in have]
    if missing:
        spec = ",".join(str(i) for i in sorted(set(have) | set(layers)))
        raise ArtifactError(f"{what} reads the target's hidden states {list(layers)} but the target outputs "
                            f"{have or 'none'}; re-export the target with --hidden-states {spec}")
    return np.concatenate([np.arange(hidden_size) + have.index(i) * hidden_size for i in layers])
