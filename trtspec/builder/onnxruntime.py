"""Build for onnxruntime: the step graph after onnxruntime's offline optimisations, saved once."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from ..engines.onnxruntime import session_options
from ..manifest import ENGINE_FORMAT, atomic_artifact, export_source, versions

log = logging.getLogger("trtspec.build")


def build_onnxruntime(export_dir: Path, export_manifest: dict, out_dir: Path) -> Path:
    import onnxruntime as ort

    t0 = time.perf_counter()
    graph = export_manifest["graph"]
    external = f"{graph}.data" in export_manifest["files"]
    manifest = {
        "format": ENGINE_FORMAT,
        "backend": "onnxruntime",
        "graph": graph,
        "tokenizer": export_manifest["tokenizer"],
        "model": export_manifest["model"],
        "build": {"graph_optimization_level": "extended", "external_data": external},
        "source": export_source(export_dir),
        "versions": versions("onnxruntime", "onnx"),
    }
    with atomic_artifact(out_dir, manifest) as tmp:
        so = session_options(num_threads=None)
        so.optimized_model_filepath = str(tmp / graph)
        if external:
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{graph}.data")
        log.info("optimising %s with onnxruntime %s", export_dir / graph, ort.__version__)
        ort.InferenceSession(str(export_dir / graph), so, providers=["CPUExecutionProvider"])
        shutil.copytree(export_dir / export_manifest["tokenizer"], tmp / export_manifest["tokenizer"])
    log.info("wrote %s in %.1f s", out_dir, time.perf_counter() - t0)
    return out_dir
