"""The step's small ops alone (kernels.silu_mul, rms_norm, rope_qkv: csrc/step_ops.cpp) per ISA path, on SmolLM2's
shapes (hidden 576, 9 heads over 3 key heads of 64, intermediate 1536), T rows a call, 2 threads.

    python benchmarks/bench_step_ops.py [--paths avx2 avx512vnni reference] [--rows 1 5 17] [--out NAME]

The ops' vector width follows the kernels' path (kernels.use_path), so on an AVX-512 machine --paths avx2 times what
an AVX2-only CPU runs, and the portable path (`reference`) what one without AVX2 runs. Each path's output is checked
bit for bit against the portable path's before it is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf_kernels import _cpu  # noqa: E402
from bench_attention import finish, op_table  # noqa: E402
from common import median_time  # noqa: E402

HIDDEN, HEADS, KV_HEADS, D, INTERMEDIATE = 576, 9, 3, 64, 1536


def _ops(T: int):
    """{name: a call of the op on T rows} for SmolLM2's shapes."""
    import torch

    from trtspec import kernels

    g = torch.Generator().manual_seed(T)
    x, w = torch.randn(1, T, HIDDEN, generator=g), torch.rand(HIDDEN, generator=g) + 0.5
    gate_up = torch.randn(1, T, 2 * INTERMEDIATE, generator=g) * 3
    qkv = torch.randn(1, T, (HEADS + 2 * KV_HEADS) * D, generator=g)
    angle = torch.rand(1, T, D, generator=g) * 6
    cos, sin = angle.cos(), angle.sin()
    return {"silu_mul": lambda: kernels.silu_mul(gate_up), "rms_norm": lambda: kernels.rms_norm(x, w, 1e-5),
            "rope_qkv": lambda: torch.cat([t.flatten() for t in kernels.rope_qkv(qkv, cos, sin, HEADS, KV_HEADS)])}


def main() -> None:
    import torch

    from trtspec import kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", nargs="*", help="ISA paths (default: every path this CPU runs)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 17])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", help="results name under benchmarks/results/ (default: print only)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    kernels.load()
    paths = args.paths or kernels.paths()
    cpu = _cpu()
    rows = []
    for T in args.rows:
        for name, call in _ops(T).items():
            kernels.use_path("reference")
            expected = call().view(torch.int32)
            for path in paths:
                kernels.use_path(path)
                if not torch.equal(call().view(torch.int32), expected):
                    raise SystemExit(f"{path}: {name} differs from the portable path at T={T}")
                for _ in range(args.calls // 10):
                    call()
                us = median_time(call, args.calls) * 1e6
                rows.append({"op": name, "path": path, "rows": T, "us": us})
                print(f"{name} {path} T={T}: {us:.1f} us", flush=True)
    table = op_table(cpu, args.calls, " on SmolLM2's shapes (rope_qkv's time includes concatenating its three "
                     "outputs).", ["| op | T | " + " | ".join(paths) + " |", "|---|---|" + "---|" * len(paths)])
    for T in args.rows:
        for name in ("silu_mul", "rms_norm", "rope_qkv"):
            us = {r["path"]: r["us"] for r in rows if r["op"] == name and r["rows"] == T}
            table.append(f"| {name} | {T} | " + " | ".join(f"{us[p]:.1f}" for p in paths) + " |")
    finish(args.out, {"cpu": cpu, "calls": args.calls, "rows": rows}, table)


if __name__ == "__main__":
    main()
