"""An engine that carries its EAGLE-3 head (`trtspec build ... --head DIR`): the head, exported for the engine while
the engine is written, in its ``head/`` directory, which the engine manifest's ``head`` section names; the runtime
finds it there (runtime/drafters/auto.carried_head), so ``--drafter eagle3`` and ``auto`` need no ``--draft``.

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


def carry_head(head, engine_tmp: Path, manifest: dict, model_path) -> dict:
    """Export the head for the engine being written in ``engine_tmp`` (its manifest not yet on disk) into
    ``engine_tmp/head``, its matrices in 8-bit blocks, the head's embedding (when it has none) from
    ``model_path``; -> the manifest's ``head``."""
    from .export import export_head_for

    export_head_for(head, engine_tmp / HEAD_DIR, target=engine_tmp, target_manifest=manifest, target_model=model_path,
                    weight_bits=WEIGHT_BITS)
    log.info("carried the EAGLE-3 head %s in %s/", head, HEAD_DIR)
    return {"kind": "eagle3", "path": HEAD_DIR, "source": str(Path(head).resolve())}


HEAD_CARRIERS["eagle3"] = carry_head
