"""Stage 4: generation over engines (plain or speculative), with continuous batching."""

from .generator import GenerationOutput, Generator, Stream
from .request import BatchStats, GenerationResult, RequestHandle, RequestStats, SchedulerStats
from .sampling import SamplingParams
from .scheduler import DRAFTERS, Scheduler
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
