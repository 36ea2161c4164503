"""Stage 3: export/<name>/ -> engines/<name>/ for one backend."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArtifactError
from ..manifest import EXPORT_FORMAT, MANIFEST, read_manifest

BACKENDS = ("onnxruntime", "tensorrt", "torch")


def default_backend(path: str | os.PathLike, *, weights: str | None = None, fuse_qdq: bool | None = None,
                    fusion: bool | None = None) -> str:
    """The backend ``build`` picks for ``path`` when none is named. torch for the model itself (an HF directory or a
    GGUF file: only it builds without an export) and for an export of a GGUF file built on the file's own blocks,
    where trtspec's GGUF kernels compile: its calls cost a third of the onnxruntime engine's on SmolLM2
    (benchmarks/results/torch-gguf.md). onnxruntime otherwise, and where an onnxruntime-only option was given."""
    from ..exporter.gguf import find_gguf

    path = Path(path)
    if not (path / MANIFEST).is_file():
        model = (path / "config.json").is_file() or find_gguf(path) is not None
        return "torch" if model else "onnxruntime"  # (onnxruntime: read_manifest then says what is missing)
    manifest = read_manifest(path)
    if (manifest.get("format") != EXPORT_FORMAT or "gguf" not in manifest or weights == "float"
            or fuse_qdq is not None or fusion is not None):
        return "onnxruntime"
    from .. import kernels

    if kernels.load() != "native":  # its warning says why; the pure-torch path would be several times slower
        return "onnxruntime"
    return "torch"


# head kind -> start(head_dir, engine_tmp, manifest, model_path, embedding=None) -> finish() -> the manifest's
# ``head`` section: makes a head in an engine being built, started before the target's compile and finished after
# it (``embedding``: the target's, as the build loaded it). heads/carried.py registers EAGLE-3's (the heads sit above
# the builder).
HEAD_CARRIERS: dict = {}


def build(export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, backend: str | None = None,
          fuse_qdq: bool | None = None, weights: str | None = None, int8_activations: bool = False,
          fusion: bool | None = None, max_prefill: int | None = None, verify_tokens: list[int] | None = None,
          max_batch: int | None = None, workspace_mib: int | None = None,
          timing_cache: str | os.PathLike | None = None, device: str | None = None,
          max_seq_len: int | None = None, head: str | os.PathLike | None = None, hidden_states=None) -> Path:
    """Build an engine artifact for ``backend`` from an export artifact; returns out_dir. ``trtspec build`` is this
    call. ``backend`` None: default_backend's choice (torch for an export of a GGUF file, onnxruntime for other
    exports). Any other option None: the backend's default; an option of another backend is refused.

    For onnxruntime: ``fuse_qdq`` (default True: quantized weights run in onnxruntime's quantized kernels),
    ``weights`` (an export of a GGUF file: "gguf", the default, runs the file's own quantized blocks; "float" its
    dequantized float graph), ``int8_activations`` (those blocks' MatMulNBits with int8 activations: faster, but
    no longer token for token under speculation) and ``fusion`` (default True: the graph lowered to onnxruntime's
    fused CPU kernels, see builder/ort_lowering.py; False keeps the plain graph). For TensorRT: ``max_prefill``,
    ``verify_tokens``, ``max_batch`` (default: the export's), ``workspace_mib``, ``timing_cache`` (see
    builder.tensorrt.build_tensorrt). For torch (the step module compiled ahead of time by AOTInductor,
    torch_backend/aot.py): ``weights`` ("gguf", the default for an export of a GGUF file: the linear layers on
    trtspec's GGUF kernels, the file's own blocks; "float"), ``int8_activations`` (the kernels' int8 variant) and
    ``device`` ("cpu", the default, or "cuda"). The torch backend also builds straight from an HF model directory
    or a GGUF file, without an export (which it does not read): then ``max_seq_len`` and ``max_batch`` size its
    cache (default 512 and 4), ``hidden_states`` adds the features output for draft heads, and ``head`` (an
    EAGLE-3 head's directory) makes the engine carry that head (heads/carried.py).
    """
    export_dir = Path(export_dir)
    if backend is None:
        backend = default_backend(export_dir, weights=weights, fuse_qdq=fuse_qdq, fusion=fusion)
    direct = backend == "torch" and not (export_dir / MANIFEST).is_file()  # the model itself, not an export of it
    if max_seq_len is not None and not direct:
        raise ValueError("--max-seq-len applies only to --backend torch built from the model itself (an HF directory "
                         "or a GGUF file); an export fixed its own when it was exported")
    if backend == "torch" and max_batch is not None and not direct:
        raise ValueError("--max-batch with --backend torch applies only to a build from the model itself (an HF "
                         "directory or a GGUF file); an export fixed its own when it was exported")
    manifest = None if direct else read_manifest(export_dir)
    if manifest is not None and manifest["format"] != EXPORT_FORMAT:
        raise ArtifactError(f"{export_dir} is a built engine, not an export; pass the export/ directory it came from")
    tensorrt_only = {"max_prefill": max_prefill, "verify_tokens": verify_tokens,
                     "max_batch": None if backend == "torch" else max_batch, "workspace_mib": workspace_mib,
                     "timing_cache": timing_cache}
    tensorrt_options = {name: value for name, value in tensorrt_only.items() if value is not None}
    if (head is not None or hidden_states is not None) and backend != "torch":
        raise ValueError("--head and --hidden-states apply to --backend torch built from a GGUF file or an HF "
                         "directory; for the other backends export with --hidden-states and pass the head with "
                         "--draft")
    if device is not None and backend != "torch":
        raise ValueError("--device applies only to --backend torch; an onnxruntime engine runs on the CPU and a "
                         "TensorRT engine on the GPU it was built on")
    if backend in ("onnxruntime", "torch") and tensorrt_options:
        raise ValueError(f"build options {', '.join(sorted(tensorrt_options))} apply only to --backend tensorrt; "
                         "drop them or pass --backend tensorrt")
    if backend == "torch":
        if fuse_qdq is not None or fusion is not None:
            raise ValueError("--no-qdq-fusion and --no-fusion apply only to --backend onnxruntime; drop them")
        from ..torch_backend.aot import build_torch

        return build_torch(export_dir, manifest, Path(out_dir), weights=weights, int8_activations=int8_activations,
                           device=device or "cpu", max_seq_len=max_seq_len, max_batch=max_batch,
                           hidden_states=hidden_states, head=head, carry=HEAD_CARRIERS.get("eagle3"))
    if backend == "onnxruntime":
        if tensorrt_options:
            raise ValueError(f"build options {', '.join(sorted(tensorrt_options))} apply only to --backend tensorrt; "
                             "drop them or pass --backend tensorrt")
        from .onnxruntime import build_onnxruntime

        return build_onnxruntime(export_dir, manifest, Path(out_dir), fuse_qdq=fuse_qdq is not False,
                                 fusion=fusion is not False, weights=weights, int8_activations=int8_activations)
    if backend == "tensorrt":
        if fuse_qdq is not None:
            raise ValueError("--no-qdq-fusion applies only to --backend onnxruntime; TensorRT places Q/DQ itself")
        if fusion is not None:
            raise ValueError("--no-fusion applies only to --backend onnxruntime; TensorRT fuses the graph itself")
        if int8_activations:
            raise ValueError("--int8-activations applies only to --backend onnxruntime (its MatMulNBits kernel)")
        if weights not in (None, "float"):
            raise ValueError("--weights gguf (the GGUF's own blocks, as onnxruntime's MatMulNBits) applies only to "
                             "--backend onnxruntime; TensorRT builds the export's float graph: pass --weights float")
        from .tensorrt import build_tensorrt

        return build_tensorrt(export_dir, manifest, Path(out_dir), **tensorrt_options)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
