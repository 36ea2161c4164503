"""Stage 3: export/<name>/ -> engines/<name>/ for one backend."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArtifactError, BackendUnavailableError
from ..manifest import EXPORT_FORMAT, read_manifest

BACKENDS = ("onnxruntime", "tensorrt")


def build(export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, backend: str = "onnxruntime") -> Path:
    """Build an engine artifact for ``backend`` from an export artifact; returns out_dir."""
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    if manifest["format"] != EXPORT_FORMAT:
        raise ArtifactError(f"{export_dir} is a built engine, not an export; pass the export/ directory it came from")
    if backend == "onnxruntime":
        from .onnxruntime import build_onnxruntime

        return build_onnxruntime(export_dir, manifest, Path(out_dir))
    if backend == "tensorrt":
        raise BackendUnavailableError(
            "--backend tensorrt is not implemented in this version of trtspec; use --backend onnxruntime"
        )
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
