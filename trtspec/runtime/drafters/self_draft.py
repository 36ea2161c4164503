"""The target's own INT4 build as its draft: speculation for a user who has no draft model.

``self_draft(target)`` quantizes the export the target was built from (int4-gptq, tied or untied lm_head
included, in blocks of 128 along K, or of the largest supported block that divides the hidden size) and builds
it for onnxruntime, once: the result sits next to the target engine (``<target>-self-int4-gptq``) and is reused
while the export is unchanged. On the bundled target (`benchmarks/bench_int4.py`, `bench_quant.py --out
quant-int4-blocks`) this beats the int4-awq block-32 self-draft it replaced: speculation 1.96x vs 1.76x at k = 4,
perplexity +0.4 % vs +0.8 % of float32, quantized in 14 s instead of 104. ``Generator(target, draft="self")``,
``Scheduler(..., draft="self")`` and ``trtspec generate/serve/bench --draft self`` call it. The draft then reads
a quarter of the target's bytes per token and agrees with it on most tokens; greedy output stays the target's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ...errors import ArtifactError
from ...manifest import EXPORT_FORMAT, MANIFEST, read_manifest, sha256_file

SELF = "self"
SELF_DRAFT_MODE = "int4-gptq"
SELF_DRAFT_BLOCK_SIZE = None  # block_for the export: 128 where it divides the hidden size
# an export of a GGUF file drafts with the file's own blocks (its onnxruntime build with int8 activations)
GGUF_SELF_DRAFT = "gguf-blocks"
log = logging.getLogger("trtspec.self_draft")


def _export_of(target_dir: Path, manifest: dict) -> Path:
    if manifest["format"] == EXPORT_FORMAT:
        return target_dir
    source = manifest.get("source") or {}
    export_dir = Path(source.get("export_dir", ""))
    if not source.get("export_dir") or not (export_dir / MANIFEST).is_file():
        raise ArtifactError(f"--draft self builds the INT4 draft from the export {target_dir} was built from "
                            f"({source.get('export_dir') or 'not recorded'}), which is missing; export the model "
                            "again (trtspec export) and rebuild, or pass a draft model with --draft PATH")
    if sha256_file(export_dir / MANIFEST) != source.get("export_manifest_sha256"):
        raise ArtifactError(f"{export_dir} changed after {target_dir} was built from it; rebuild the target "
                            "(trtspec build) so that the self-draft and the target come from the same weights")
    return export_dir


def block_for(export_dir: Path) -> int:
    """The INT4 block size of the self-draft: the largest supported one that divides the embedding's width.

    A weight whose K the block does not divide is padded to whole blocks (its last block is ragged), but the
    tied embedding/lm_head table is quantized only in whole blocks of the hidden size; on the usual widths
    (multiples of 128) this is 128, the fastest and, with GPTQ, the most accurate block measured.
    """
    import onnx

    from ...quantization.quantize import BLOCK_SIZES

    graph = onnx.load(str(export_dir / read_manifest(export_dir)["graph"]), load_external_data=False).graph
    dims = {i.name: list(i.dims) for i in graph.initializer}
    widths = {dims[n.input[0]][1] for n in graph.node  # the embedding lookup (not the RoPE tables' by position)
              if n.op_type == "Gather" and n.input[1] == "input_ids" and len(dims.get(n.input[0], ())) == 2}
    return max((b for b in BLOCK_SIZES if all(w % b == 0 for w in widths)), default=min(BLOCK_SIZES))


def self_draft(target, out_dir: str | os.PathLike | None = None, *, mode: str = SELF_DRAFT_MODE,
               block_size: int | None = SELF_DRAFT_BLOCK_SIZE, calib_samples: int | None = None) -> Path:
    """The INT4 onnxruntime engine of ``target``'s own export (built if missing or stale); returns its directory.
    For the float build of a GGUF file's export, the draft is the file's own blocks (``GGUF_SELF_DRAFT``: the
    export's onnxruntime build with int8 activations); a target that already runs those blocks is refused.

    ``target``: an engine or export directory, or a loaded engine. ``out_dir`` defaults to
    ``<target>-self-<mode>`` beside it. ``block_size`` None: ``block_for`` the export.
    """
    from ...builder import build
    from ...quantization import quantize

    target_dir = Path(getattr(target, "path", target))
    manifest = getattr(target, "manifest", None) or read_manifest(target_dir)
    quantized = (manifest.get("quantization") or {}).get("mode")
    if quantized and quantized != "gguf":  # (a GGUF file's own blocks: below)
        raise ArtifactError(f"{target_dir} is already quantized ({quantized}); --draft self drafts a float target "
                            "with its INT4 build")
    export_dir = _export_of(target_dir, manifest)
    gguf = "gguf" in read_manifest(export_dir)
    if gguf:
        if manifest["format"] != EXPORT_FORMAT and manifest.get("build", {}).get("weights") != "float":
            raise ArtifactError(
                f"{target_dir} runs its GGUF file's own blocks, which are what --draft self would draft with: the "
                "draft would be the target. Draft with --drafter suffix or prompt_lookup (no model), or pass a "
                "smaller draft model with --draft PATH; --draft self drafts the float build (--weights float)")
        mode, block_size = GGUF_SELF_DRAFT, None  # the file's own blocks, as the onnxruntime build runs them
    elif block_size is None:
        block_size = block_for(export_dir)
    out = Path(out_dir) if out_dir is not None else target_dir.with_name(f"{target_dir.name}-self-{mode}")
    stamp = {"export_manifest_sha256": sha256_file(export_dir / MANIFEST), "mode": mode, "block_size": block_size}
    if (out / MANIFEST).is_file():
        made = read_manifest(out).get("self_draft")
        if made == stamp:
            return out
        if made is None:
            raise ArtifactError(f"{out} exists and is not a self-draft of {target_dir}; move it or pass another out_dir")
        log.info("%s was made from another export or with other settings; rebuilding it", out)
    log.info("building the self-draft of %s: %s of %s (once; it is reused while the export is unchanged)",
             target_dir, mode, export_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        if gguf:
            built = build(export_dir, Path(tmp) / "engine", weights="gguf", int8_activations=True)
        else:
            quantized = quantize(export_dir, Path(tmp) / "export", mode=mode, block_size=block_size,
                                 calib_samples=calib_samples, quantize_lm_head=True)
            built = build(quantized, Path(tmp) / "engine")
        manifest_path = built / MANIFEST
        engine_manifest = json.loads(manifest_path.read_text())
        engine_manifest["self_draft"] = stamp
        manifest_path.write_text(json.dumps(engine_manifest, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(built, out)
    return out
