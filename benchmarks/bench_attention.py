"""trtspec's attention op alone (kernels.attention_rows_tokens, as the int8 step calls it), per ISA path: SmolLM2's
shape (9 query heads over 3 key heads, D = 64, a 2048-slot cache), T query rows at a cache position, 2 threads.

    python benchmarks/bench_attention.py [--paths avx2 avx512] [--positions 100 1500] [--rows 1 5 17] [--out NAME]

Another revision's kernels: run this file with PYTHONPATH set to that revision's checkout (a script's own folder,
not the repository, is first on sys.path, so trtspec comes from PYTHONPATH). Every path's output is checked equal
to the portable path's before it is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf_kernels import _cpu  # noqa: E402
from common import RESULTS, median_time, save_results  # noqa: E402



def _case(T: int, position: int):
    import torch

    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, 9, T, 64, generator=g)
    k, v = torch.randn(1, 3, 2048, 64, generator=g), torch.randn(1, 3, 2048, 64, generator=g)
    mask = torch.zeros(1, 1, T, 2048, dtype=torch.bool)
    for t in range(T):
        mask[0, 0, t, :position + t + 1] = True
    return q, k, v, mask


def main() -> None:
    import torch

    from trtspec import kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", nargs="*", help="ISA paths (default: every path this CPU runs but the portable one)")
    ap.add_argument("--positions", type=int, nargs="+", default=[100, 1500])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 17])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", help="results name under benchmarks/results/ (default: print only)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    kernels.load()
    paths = args.paths or [p for p in kernels.paths() if p != "reference"]
    cpu = _cpu()
    rows = []
    for position in args.positions:
        for T in args.rows:
            q, k, v, mask = _case(T, position)
            kernels.use_path("reference")
            expected = kernels.attention_rows_tokens(q, k, v, mask, 0.125)
            for path in paths:
                kernels.use_path(path)
                out = kernels.attention_rows_tokens(q, k, v, mask, 0.125)
                if not torch.equal(out, expected):
                    raise SystemExit(f"{path}: attention differs from the portable path at T={T}, position {position}")
                us = median_time(lambda: kernels.attention_rows_tokens(q, k, v, mask, 0.125), args.calls) * 1e6
                rows.append({"path": path, "position": position, "rows": T, "us": us})
                print(f"{path} position {position} T={T}: {us:.1f} us", flush=True)
    table = op_table(cpu, args.calls, ", 9 heads over 3 key heads, D = 64, a 2048-slot cache.",
                     ["| path | position | T | us |", "|---|---|---|---|"])
    table += [f"| {r['path']} | {r['position']} | {r['rows']} | {r['us']:.1f} |" for r in rows]
    finish(args.out, {"cpu": cpu, "calls": args.calls, "rows": rows}, table)


def op_table(cpu: dict, calls: int, what: str, header: list[str]) -> list[str]:
    """An op's table: its caption (the CPU, its ISA, the threads, trtspec's checkout, the calls; ``what``), then
    ``header``."""
    from trtspec import kernels

    return [f"CPU: {cpu['model']}; ISA: {' '.join(cpu['isa'])}; 2 threads; trtspec from "
            f"{Path(kernels.__file__).resolve().parents[2]}. Median us of {calls} calls{what}", "", *header]


def finish(out: str | None, measured: dict, table: list[str]) -> None:
    """benchmarks/results/``out``.{json,md}, or (no ``out``) the table printed."""
    if out:
        save_results(RESULTS / out, measured, "\n".join(table) + "\n")
    else:
        print("\n".join(table))


if __name__ == "__main__":
    main()
