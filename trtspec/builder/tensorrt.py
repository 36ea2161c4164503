"""Build for TensorRT 11: the step graph parsed by TensorRT's ONNX parser into one plan with several profiles.

Written against the documented TensorRT 11 Python API; tensorrt is imported
only here, after the options and the graph have been checked on CPU. TensorRT
11 networks are always strongly typed: precision comes from the graph's own
types and Q/DQ nodes, there are no precision flags to set.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..engines.tensorrt_compat import compute_capability, import_tensorrt
from ..errors import ArtifactError, BackendUnavailableError
from ..manifest import ENGINE_FORMAT, atomic_artifact, carry_files, export_source, versions
from .tensorrt_check import check_export, format_report
from .tensorrt_plan import DEFAULT_VERIFY_TOKENS, profile_plan

log = logging.getLogger("trtspec.build")

PLAN_FILE = "model.plan"


def network_flags(trt) -> int:
    """Creation flags for builder.create_network: STRONGLY_TYPED where the enum still has it.

    TensorRT 10.x needs the flag for a strongly typed network; in 11.x every
    network is strongly typed and the flag is accepted but has no effect.
    """
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def progress_monitor(trt):
    """An IProgressMonitor that logs the builder's top-level phases (a build can take minutes)."""

    class BuildProgress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                log.info("tensorrt: %s (%d steps)", phase_name, num_steps)

        def step_complete(self, phase_name, step):
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            log.debug("tensorrt: %s done", phase_name)

    return BuildProgress()


def _parse(trt, builder, logger, graph_path: Path):
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves external weight files next to the graph.
    if not parser.parse_from_file(str(graph_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise ArtifactError(f"TensorRT's ONNX parser refused {graph_path}:\n  " + "\n  ".join(errors))
    return network, parser


def _add_profiles(builder, config, plan: dict):
    for expected, profile in enumerate(plan["profiles"]):
        opt_profile = builder.create_optimization_profile()
        for name, shape in profile["shapes"].items():
            opt_profile.set_shape(name, shape["min"], shape["opt"], shape["max"])
        index = config.add_optimization_profile(opt_profile)
        assert index == expected, "the plan's profile order is the engine's profile (and context) order"


def _load_timing_cache(config, path: Path | None):
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(data)  # empty bytes: a new cache
    # ignore_mismatch=False: a cache from another GPU or TensorRT version is not silently mixed in.
    config.set_timing_cache(cache, False)
    return cache


def _save_timing_cache(cache, path: Path):
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(bytes(cache.serialize()))
    os.replace(tmp, path)


def build_tensorrt(
    export_dir: Path,
    export_manifest: dict,
    out_dir: Path,
    *,
    max_prefill: int | None = None,
    verify_tokens=DEFAULT_VERIFY_TOKENS,
    max_batch: int | None = None,
    workspace_mib: int | None = None,
    timing_cache: str | os.PathLike | None = None,
) -> Path:
    plan = profile_plan(export_manifest["model"], max_prefill=max_prefill, verify_tokens=verify_tokens, max_batch=max_batch)
    if workspace_mib is not None and workspace_mib < 1:
        raise ValueError(f"workspace must be at least 1 MiB (got {workspace_mib})")
    problems = check_export(export_dir)
    if problems:
        raise ArtifactError(format_report(export_dir, problems) + "\nfix the export (see `trtspec check`) before building for TensorRT")
    trt = import_tensorrt()
    capability = compute_capability()
    check_precision_support(export_manifest, capability)
    t0 = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser = _parse(trt, builder, logger, export_dir / export_manifest["graph"])
    config = builder.create_builder_config()
    if workspace_mib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    cache_path = Path(timing_cache) if timing_cache is not None else None
    cache = _load_timing_cache(config, cache_path)
    monitor = progress_monitor(trt)  # must outlive the build
    config.progress_monitor = monitor
    _add_profiles(builder, config, plan)
    log.info("building %s with TensorRT %s for compute capability %s (%d profiles)",
             export_dir, trt.__version__, capability, len(plan["profiles"]))
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ArtifactError(f"TensorRT failed to build {export_dir}; its log above says why")
    if cache_path is not None:
        _save_timing_cache(cache, cache_path)
    manifest = _engine_manifest(export_dir, export_manifest, plan, trt.__version__, capability, workspace_mib, cache_path)
    with atomic_artifact(out_dir, manifest) as tmp:
        (tmp / PLAN_FILE).write_bytes(bytes(serialized))
        carry_files(export_dir, export_manifest, tmp)
    log.info("wrote %s in %.1f s", out_dir, time.perf_counter() - t0)
    return out_dir


# Quantized types and the GPUs whose tensor cores run them (TensorRT's support matrix): FP8 E4M3
# needs Ada (8.9) or Hopper (9.0) and later.
MIN_CAPABILITY = {"fp8": (8, 9)}


def check_precision_support(export_manifest: dict, capability: str) -> None:
    """Refuse to build a quantized export for a GPU that has no kernels for its types."""
    quantization = export_manifest.get("quantization") or {}
    have = tuple(int(v) for v in capability.split("."))
    for fmt in {quantization.get("weights"), quantization.get("activations")} - {None}:
        need = MIN_CAPABILITY.get(fmt)
        if need is not None and have < need:
            raise BackendUnavailableError(
                f"this export is quantized to {fmt} ({quantization['mode']}), which TensorRT runs only on GPUs of "
                f"compute capability {need[0]}.{need[1]} or newer (Ada, Hopper); this GPU is {capability}. "
                "Quantize with int8-sq or int4-awq instead"
            )


def _engine_manifest(export_dir, export_manifest, plan, trt_version, capability, workspace_mib, cache_path) -> dict:
    return {
        "format": ENGINE_FORMAT,
        "backend": "tensorrt",
        "plan_file": PLAN_FILE,
        "tokenizer": export_manifest["tokenizer"],
        "model": export_manifest["model"],
        "profile_plan": plan,
        "tensorrt": {"version": trt_version, "compute_capability": capability},
        "build": {"workspace_mib": workspace_mib, "timing_cache": str(cache_path) if cache_path else None},
        "source": export_source(export_dir),
        "versions": {**versions("onnx"), "tensorrt": trt_version},
    }
