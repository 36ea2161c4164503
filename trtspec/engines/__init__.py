"""Engine backends behind one protocol; load_engine() picks the backend an artifact was built for."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArtifactError
from ..manifest import ENGINE_FORMAT, EXPORT_FORMAT, read_manifest
from .base import Engine

BACKENDS = ("onnxruntime", "tensorrt", "torch")


def load_engine(path: str | os.PathLike, *, backend: str | None = None, num_threads: int | None = None) -> Engine:
    """Load an engines/ artifact (or run an export/ artifact directly with onnxruntime)."""
    path = Path(path)
    manifest = read_manifest(path)
    built_for = "onnxruntime" if manifest["format"] == EXPORT_FORMAT else manifest.get("backend")
    if backend is not None and backend != built_for:
        what = "an export artifact (runs on onnxruntime)" if manifest["format"] == EXPORT_FORMAT else f"built for {built_for}"
        raise ArtifactError(f"{path} is {what}, not for backend {backend!r}; build it with `trtspec build --backend {backend}`")
    if built_for == "onnxruntime":
        from .onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(path, manifest, num_threads=num_threads)
    if built_for == "tensorrt":
        from .tensorrt import TensorRTEngine

        return TensorRTEngine(path, manifest)  # num_threads is a CPU setting; a GPU engine has none
    if built_for == "torch":
        from .torch_aot import TorchAOTEngine

        return TorchAOTEngine(path, manifest, num_threads=num_threads)
    raise ArtifactError(f"{path}: unknown backend {built_for!r} in its manifest (known: {', '.join(BACKENDS)})")


__all__ = ["Engine", "load_engine", "BACKENDS", "ENGINE_FORMAT"]
