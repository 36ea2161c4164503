"""An engine that carries its EAGLE-3 head (`trtspec build ... --head DIR`): the head, made for the engine while
the engine is written, in its ``head/`` directory, which the engine manifest's ``head`` section names; the runtime
finds it there (runtime/drafters/auto.carried_head), so ``--drafter eagle3`` and ``auto`` need no ``--draft``.

The head is compiled as the engine is (heads/compiled.py: an AOTInductor package on trtspec's kernels, its
matrices in 8-bit blocks), or, where those kernels cannot be built, exported as an onnxruntime step graph with
its matrices in onnxruntime's 8-bit blocks (heads/export.py).

The builder sits below the heads, so it does not import this module: importing trtspec registers ``carry_head``
in builder.HEAD_CARRIERS, which the torch build calls inside its atomic write (an interrupted build leaves no
engine, with or without its head).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..builder import HEAD_CARRIERS
from ..runtime.drafters.auto import HEAD_DIR

log = logging.getLogger("trtspec.build")
WEIGHT_BITS = 8  # the carried head's matrices in 8-bit blocks: a head call costs what it reads (heads/export.py)


def carry_head(head, engine_tmp: Path, manifest: dict, model_path, embedding=None) -> dict:
    """Make the head for the engine being written in ``engine_tmp`` (its manifest not yet on disk) in
    ``engine_tmp/head``, its matrices in 8-bit blocks, the head's embedding (when it has none) ``embedding``, the
    target's as the build loaded it, or read from ``model_path``; -> the manifest's ``head``."""
    import json

    from .. import kernels
    from .compiled import compile_head_for, not_compilable
    from .eagle3 import CONFIG, Eagle3Config

    where = engine_tmp / HEAD_DIR
    if kernels.load() == "native":
        why = not_compilable(Eagle3Config.from_dict(json.loads((Path(head) / CONFIG).read_text())))
    else:
        why = f"trtspec's kernels could not be built here ({kernels.status().get('reason')})"
    if why is None:
        compile_head_for(head, where, target=engine_tmp, target_manifest=manifest, target_model=model_path,
                         embedding=embedding)
        form = "compiled"
    else:
        from .export import export_head_for

        log.warning("the EAGLE-3 head runs on onnxruntime, not compiled: %s", why)
        export_head_for(head, where, target=engine_tmp, target_manifest=manifest, target_model=model_path,
                        weight_bits=WEIGHT_BITS, embedding=embedding)
        form = "onnxruntime"
    log.info("carried the EAGLE-3 head %s in %s/ (%s)", head, HEAD_DIR, form)
    return {"kind": "eagle3", "path": HEAD_DIR, "source": str(Path(head).resolve()), "form": form}


HEAD_CARRIERS["eagle3"] = carry_head
