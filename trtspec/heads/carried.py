"""An engine that carries its EAGLE-3 head (`trtspec build ... --head DIR`): the head, made for the engine while
the engine is written, in its ``head/`` directory, which the engine manifest's ``head`` section names; the runtime
finds it there (runtime/drafters/auto.carried_head), so ``--drafter eagle3`` and ``auto`` need no ``--draft``.

The head is compiled as the engine is (heads/compiled.py: an AOTInductor package on trtspec's kernels, its
matrices in 8-bit blocks), or, where those kernels cannot be built, exported as an onnxruntime step graph with
its matrices in onnxruntime's 8-bit blocks (heads/export.py).

The builder sits below the heads, so it does not import this module: importing trtspec registers
``start_carry_head`` in builder.HEAD_CARRIERS, which the torch build calls inside its atomic write (an interrupted
build leaves no engine, with or without its head). It makes the head in a second process while the build compiles
the target (``worker``): the two compiles share 2 cores better than they follow each other.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..builder import HEAD_CARRIERS
from ..runtime.drafters.auto import HEAD_DIR

log = logging.getLogger("trtspec.build")
WEIGHT_BITS = 8  # the carried head's matrices in 8-bit blocks: a head call costs what it reads (heads/export.py)


def carry_head(head, engine_tmp: Path, manifest: dict, model_path, embedding=None) -> dict:
    """Make the head for the engine being written in ``engine_tmp`` (its manifest not yet on disk) in
    ``engine_tmp/head``, its matrices in 8-bit blocks, the head's embedding (when it has none) ``embedding``, the
    target's as the build loaded it, or read from ``model_path``; -> the manifest's ``head``."""
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


def start_carry_head(head, engine_tmp: Path, manifest: dict, model_path, embedding=None):
    """carry_head in a second process, started now -> finish(), which waits for it and returns the manifest's
    ``head`` (finish(cancel=True): stops it, if still running; the build's way out on an error). The head is checked
    here first (a head for another model is refused before any compile); the engine's tokenizer must already be in
    ``engine_tmp`` (the head carries a copy)."""
    import numpy as np

    from .export import checked_head

    checked_head(head, engine_tmp, manifest, model_path, embedding)
    scratch = tempfile.TemporaryDirectory(prefix="trtspec-head-")
    args = [str(head), str(engine_tmp), str(Path(scratch.name) / "manifest.json"), str(model_path),
            str(Path(scratch.name) / "embedding.npy"), str(logging.getLogger("trtspec").getEffectiveLevel())]
    Path(args[2]).write_text(json.dumps(manifest))
    if embedding is not None:
        np.save(args[4], embedding.float().numpy())
    # the trtspec this process runs, whatever the child's working directory and sys.path would find
    here = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, *args], stdout=subprocess.PIPE, text=True, env=env)
    log.info("making the EAGLE-3 head %s in a second process while the target compiles", head)

    def finish(cancel: bool = False) -> dict | None:
        try:
            if cancel:
                return None
            out, _ = proc.communicate()
        finally:
            if proc.poll() is None:  # cancelled, or this process interrupted: the worker goes too
                proc.kill()
                proc.wait()
            scratch.cleanup()
        if proc.returncode:
            raise RuntimeError(f"making the EAGLE-3 head {head} failed in its process (exit {proc.returncode}); "
                               "its messages are above")
        return json.loads(out.strip().splitlines()[-1])

    finish.process = proc
    return finish


HEAD_CARRIERS["eagle3"] = start_carry_head


WORKER = "import sys; from trtspec.heads.carried import worker; worker(*sys.argv[1:])"


def worker(head, engine_tmp, manifest_file, model_path, embedding_file, level) -> None:
    """start_carry_head's second process: carry_head, then the manifest's ``head`` as JSON on stdout."""
    import numpy as np
    import torch

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("trtspec: %(message)s"))
    logging.getLogger("trtspec").addHandler(handler)
    logging.getLogger("trtspec").setLevel(int(level))
    embedding = torch.from_numpy(np.load(embedding_file)) if Path(embedding_file).is_file() else None
    section = carry_head(head, Path(engine_tmp), json.loads(Path(manifest_file).read_text()), model_path,
                         embedding=embedding)
    print(json.dumps(section))

