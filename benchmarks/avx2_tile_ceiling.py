"""How close the AVX2 int8 tiles run to what their instructions allow: products a cycle, hot, one thread.

    python benchmarks/avx2_tile_ceiling.py [--rounds 7] [--out NAME]

Compiles, with the machine's C++ compiler, three small programs around csrc/gguf_linear_avx2.h (without VNNI) and runs
them alternately, one thread each, on 4 panels of Q4_1 and Q8_0 (576 deep, in L1/L2):
  tiles        the kernels as they are (int8_any: 1 to 12 rows);
  no-float     the same with each group's float steps (widening, conversion, scale, minimum, the activation's scale)
               replaced by one add: what the exact float steps cost;
  ceiling      a loop of nothing but a broadcast, maddubs and an int16 add per 32 products, 6 sums in flight.
Cycles are the time at the clock a chain of dependent adds runs at (no performance counters needed). Scratch
figures for reasoning, not results of the product: the no-float program computes wrong sums on purpose.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf_kernels import _cpu  # noqa: E402

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "trtspec" / "kernels" / "csrc"
RESULTS = HERE / "results"
FLOAT_STEPS = """    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(idot), scale);
    if constexpr (F::has_min) t = _mm256_add_ps(t, _mm256_mul_ps(minimum, _mm256_set1_ps(x.fsum[i + r])));
    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(t, _mm256_set1_ps(x.scale[i + r])));"""
NO_FLOAT_STEPS = "    (void)scale; (void)minimum; acc[r] = _mm256_add_ps(acc[r], _mm256_castsi256_ps(idot));"

HARNESS = r"""
#pragma GCC target("avx2,fma,f16c")
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "tiles.h"
using namespace trtspec_gguf;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// products a second of int8_any over P panels of K, m rows
template <typename F>
double rate(int m, int64_t P, int64_t K, long reps) {
  Weights w;
  w.k = K; w.group = 32; w.groups = K / 32; w.bits = F::bits; w.zero = 0; w.has_min = F::has_min;
  w.half_scales = F::half; w.codes_bytes = F::codes_bytes; w.floats_bytes = F::floats_bytes;
  w.group_bytes = F::group_bytes;
  std::vector<uint8_t> data(P * w.groups * F::group_bytes + 8192);
  std::mt19937 g(1);
  for (auto& b : data) b = g() & 0xFF;
  const uint16_t one = 0x3C00;  // float16 1.0 for every scale and minimum
  for (int64_t p = 0; p < P * w.groups; ++p)
    for (int j = 0; j < (F::has_min ? 32 : 16); ++j)
      std::memcpy(data.data() + p * F::group_bytes + F::codes_bytes + 2 * j, &one, 2);
  w.data = data.data();
  std::vector<int32_t> q(w.groups * m * 8), zs(w.groups * m);
  std::vector<float> fs(w.groups * m, 1.f), sc(w.groups * m, 0.01f), y(m * P * 16);
  for (auto& v : q) v = static_cast<int32_t>(g());
  Int8Rows x{q.data(), zs.data(), fs.data(), sc.data(), m};
  for (int i = 0; i < 100; ++i) int8_any(w, x, y.data(), P * 16, 0, P);
  const double t = now();
  for (long i = 0; i < reps; ++i) int8_any(w, x, y.data(), P * 16, 0, P);
  return double(m) * P * 16 * K * reps / (now() - t);
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "clock") == 0) {  // dependent adds: one a cycle
    long n = 200000000, a = 0;
    const double t = now();
    for (long i = 0; i < n; ++i)
      asm volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
                   "add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0" : "+r"(a));
    std::printf("clock %.4f\n", 8.0 * n / (now() - t));
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "ceiling") == 0) {
    alignas(64) int buf[64];
    for (int i = 0; i < 64; ++i) buf[i] = i;
    const int* pb = buf;
    __m256i q = _mm256_set1_epi8(3), a0 = q, a1 = q, a2 = q, a3 = q, a4 = q, a5 = q;
    const long n = 100000000;
    const double t = now();
    for (long i = 0; i < n; ++i) {
#define STEP(j) { __m256i b = _mm256_set1_epi32(pb[j]); a##j = _mm256_add_epi16(a##j, _mm256_maddubs_epi16(q, b)); }
      STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
      asm volatile("" : "+x"(q), "+r"(pb));  // opaque each pass: nothing hoisted out of the loop
    }
    const double s = now() - t;
    int r = _mm256_extract_epi16(a0, 0) + _mm256_extract_epi16(a1, 0) + _mm256_extract_epi16(a2, 0) +
            _mm256_extract_epi16(a3, 0) + _mm256_extract_epi16(a4, 0) + _mm256_extract_epi16(a5, 0);
    std::printf("ceiling %.4f %d\n", 6.0 * 32 * n / s, r & 1);
    return 0;
  }
  for (int m : {1, 2, 3, 5, 6, 12}) std::printf("Q4_1 m=%d %.4f\n", m, rate<Form<4, true, true>>(m, 4, 576, 20000));
  for (int m : {1, 5, 6}) std::printf("Q8_0 m=%d %.4f\n", m, rate<Form<8, false, true>>(m, 4, 576, 20000));
}
"""


def _compile(tmp: Path, cxx: str, name: str, header: str) -> Path:
    (tmp / name).mkdir()
    shutil.copy(CSRC / "gguf_linear.h", tmp / name / "gguf_linear.h")
    (tmp / name / "tiles.h").write_text(header)
    (tmp / name / "harness.cpp").write_text(HARNESS)
    exe = tmp / name / "run"
    subprocess.run([cxx, "-O3", "-std=c++17", "-ffp-contract=off", str(tmp / name / "harness.cpp"), "-o", str(exe)],
                   check=True)
    return exe


def _figures(exe: Path, *args: str) -> dict:
    out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True).stdout
    return {line.rsplit(" ", 1)[0] if not line.startswith(("clock", "ceiling")) else line.split()[0]:
            float(line.split()[-1] if not line.startswith(("clock", "ceiling")) else line.split()[1])
            for line in out.splitlines()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="results name under benchmarks/results/ (default: print only)")
    args = ap.parse_args()
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise SystemExit("no C++ compiler found (Debian: apt install g++)")
    tiles = (CSRC / "gguf_linear_avx2.h").read_text()
    if FLOAT_STEPS not in tiles:
        raise SystemExit("gguf_linear_avx2.h's float steps changed: update FLOAT_STEPS here")
    with tempfile.TemporaryDirectory() as tmp:
        exes = {"tiles": _compile(Path(tmp), cxx, "tiles", tiles),
                "no-float": _compile(Path(tmp), cxx, "nofloat", tiles.replace(FLOAT_STEPS, NO_FLOAT_STEPS))}
        runs = {name: [] for name in exes}
        clocks, ceilings = [], []
        for r in range(args.rounds):
            clocks.append(_figures(exes["tiles"], "clock")["clock"])
            for name, exe in exes.items():
                runs[name].append(_figures(exe))
            ceilings.append(_figures(exes["tiles"], "ceiling")["ceiling"])
            print(f"round {r + 1} of {args.rounds}", flush=True)
    clock = statistics.median(clocks)
    per_cycle = {name: {k: statistics.median(f[k] for f in figures) / clock for k in figures[0]}
                 for name, figures in runs.items()}
    cpu = _cpu()
    table = [f"CPU: {cpu['model']}; ISA: {' '.join(cpu['isa'])}; one thread; clock {clock / 1e9:.2f} GHz (dependent "
             f"adds). Products a cycle, medians of {args.rounds} alternating rounds (`python "
             "benchmarks/avx2_tile_ceiling.py`): the AVX2 int8 tiles hot on 4 panels 576 deep; the same without the "
             "float steps; a loop of broadcast, maddubs and int16 add alone: "
             f"{statistics.median(ceilings) / clock:.1f}.", "", "| rows | tiles | without the float steps |",
             "|---|---|---|"]
    table += [f"| {k} | {per_cycle['tiles'][k]:.1f} | {per_cycle['no-float'][k]:.1f} |" for k in per_cycle["tiles"]]
    print("\n".join(table))
    if args.out:
        (RESULTS / f"{args.out}.json").write_text(json.dumps(
            {"cpu": cpu, "clock_hz": clock, "ceiling_per_cycle": statistics.median(ceilings) / clock,
             "per_cycle": per_cycle, "rounds": args.rounds}, indent=2))
        (RESULTS / f"{args.out}.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
