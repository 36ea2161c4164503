"""Stage 4: generation over engines (plain or speculative)."""

from .generator import DRAFTERS, BatchStats, GenerationOutput, GenerationResult, Generator, RequestStats
from .sampling import SamplingParams
from .vocab import VocabularyMismatchError

__all__ = [
    "DRAFTERS",
    "BatchStats",
    "GenerationOutput",
    "GenerationResult",
    "Generator",
    "RequestStats",
    "SamplingParams",
    "VocabularyMismatchError",
]
