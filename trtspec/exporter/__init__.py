"""Stage 1: HF model directory -> step graph artifact (export/<name>/)."""

from .step_graph import export

__all__ = ["export"]
