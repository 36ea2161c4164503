"""Stage 4: generation over engines (plain or speculative), with continuous batching."""

from .generator import BatchStats, GenerationOutput, Generator, Stream
from .sampling import SamplingParams
from .scheduler import DRAFTERS, GenerationResult, RequestHandle, RequestStats, Scheduler, SchedulerStats
from .vocab import VocabularyMismatchError

__all__ = [
    "DRAFTERS",
    "BatchStats",
    "GenerationOutput",
    "GenerationResult",
    "Generator",
    "RequestHandle",
    "RequestStats",
    "SamplingParams",
    "Scheduler",
    "SchedulerStats",
    "Stream",
    "VocabularyMismatchError",
]
