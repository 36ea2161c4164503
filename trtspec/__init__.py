"""trtspec: fast lossless speculative decoding for Hugging Face causal LMs.

export (HF dir -> step graph) -> quantize (optional Q/DQ passes) -> build (step graph -> engine)
-> runtime (Generator).

Each `trtspec` command is one function here, with the command's options as its parameters (same names, same
defaults): export, export_head, quantize, check, build, index, generate, bench, serve, bench_serve, distill.
"""

__version__ = "0.1.0"

from .bench import bench, bench_serve
from .builder import build
from .builder.tensorrt_check import check_export as check
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
from .heads import carried as _carried  # noqa: F401 - registers the EAGLE-3 head's carrier with the builder
from .heads.export import export_head
from .quantization import quantize
from .runtime import Generator, GenerationResult, SamplingParams, Scheduler, VocabularyMismatchError
from .runtime.drafters.datastore import build_index as index
from .runtime.drafters.self_draft import self_draft
from .runtime.generate import generate
from .server.launch import serve
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
    "bench",
    "bench_serve",
    "build",
    "check",
    "compile",
    "distill",
    "export",
    "export_head",
    "generate",
    "index",
    "load_engine",
    "quantize",
    "self_draft",
    "serve",
]
