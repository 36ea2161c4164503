"""trtspec: fast lossless speculative decoding for Hugging Face causal LMs.

export (HF dir -> step graph) -> quantize (optional Q/DQ passes) -> build (step graph -> engine)
-> runtime (Generator).
"""

__version__ = "0.1.0"

from .builder import build
from .engines import load_engine
from .errors import (
    ArtifactError,
    BackendUnavailableError,
    CapacityError,
    EngineBusyError,
    TrtspecError,
    UnsupportedModelError,
)
from .distill import distill
from .exporter import export
from .heads.export import export_head
from .quantization import quantize
from .runtime import Generator, GenerationResult, SamplingParams, Scheduler, VocabularyMismatchError
from .runtime.drafters.self_draft import self_draft
from .torch_backend import compile

__all__ = [
    "ArtifactError",
    "BackendUnavailableError",
    "CapacityError",
    "EngineBusyError",
    "GenerationResult",
    "Generator",
    "SamplingParams",
    "Scheduler",
    "TrtspecError",
    "UnsupportedModelError",
    "VocabularyMismatchError",
    "__version__",
    "build",
    "compile",
    "distill",
    "export",
    "export_head",
    "load_engine",
    "quantize",
    "self_draft",
]
