"""Does an AOTInductor package load and run on this device at all, and ours with inductor's own options?

    python benchmarks/aoti_probe.py VARIANT WORK_DIR          # DEV=cpu to run it here (default: cuda)

VARIANT:
  plain               an Embedding + Linear module that writes a cache input in place, inductor's defaults:
                      torch.export, aoti_compile_and_package, aoti_load_package, one call against eager
  inductor defaults   gpu_round.aot_check (trtspec's build of a small random Qwen2 against HF) without our
                      compile options (aot.COMPILE_CONFIG) and with inductor's own input checks
  no O0 wrapper       the same with our options but the wrapper compiled at inductor's own optimisation level
  no cpp options      the same without our cpp.* (thread) options

Prints one JSON line. A crash ends the process (run it with ``python -X faulthandler`` to see where): on the lent
H200 (torch 2.11.0+cu130, 2026-11-30) the plain module's package crashed in aoti_load_package.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
DEV = os.environ.get("DEV", "cuda")


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.proj = torch.nn.Embedding(512, 64), torch.nn.Linear(64, 512)

    def forward(self, ids, cache):
        x = self.embed(ids)
        cache[:, : x.shape[1]] = x
        return self.proj(torch.relu(x))


def plain(work: Path) -> dict:
    module = Plain().to(DEV).eval()
    ids = torch.ones(2, 8, dtype=torch.long, device=DEV)
    cache = torch.zeros(2, 64, 64, device=DEV)
    program = torch.export.export(module, (ids, cache), dynamic_shapes=({1: torch.export.Dim("t", max=32)}, {}))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(work / "plain.pt2"))
    print("built; loading", file=sys.stderr, flush=True)
    runner = torch._inductor.aoti_load_package(path)
    print("loaded; calling", file=sys.stderr, flush=True)
    with torch.no_grad():
        return {"max_abs_diff": float((runner(ids, cache) - module(ids, cache)).abs().max())}


def ours(work: Path, variant: str) -> dict:
    import gpu_round

    from trtspec.torch_backend import aot

    if variant == "inductor defaults":
        aot.COMPILE_CONFIG = {}
        aot._without_input_checks = contextlib.nullcontext
    elif variant == "no O0 wrapper":
        aot.COMPILE_CONFIG = {k: v for k, v in aot.COMPILE_CONFIG.items() if "opt_level" not in k}
    elif variant == "no cpp options":
        aot.COMPILE_CONFIG = {k: v for k, v in aot.COMPILE_CONFIG.items() if not k.startswith("cpp.")}
    else:
        raise SystemExit(f"unknown variant {variant!r}; see --help")
    return gpu_round.aot_check(work, DEV, "as built")


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        raise SystemExit(__doc__)
    variant, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    row = plain(work) if variant == "plain" else ours(work, variant)
    print(json.dumps({"variant": variant, "device": DEV, **row, "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
