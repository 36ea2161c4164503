"""Training step rate of the bundled target's architecture: float32 vs bfloat16 autocast (CPU).

    python benchmarks/bench_train_step.py       # ~1 min on 2 cores

A random-init model of models/stdlib-target's shape (benchmarks/train_pair.py TARGET), batch 16 x 256 tokens,
AdamW; median over steps 3..6 of 6, tokens per second, each mode in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch
import train_pair


def main():
    torch.set_num_threads(2)
    model = train_pair.make_model(train_pair.TARGET, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, train_pair.VOCAB, (train_pair.BATCH, train_pair.SEQ))
    for mode in ("float32", "bfloat16 autocast"):
        times = []
        for _ in range(6):
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "float32"):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        print(f"{mode}: {x.numel() / statistics.median(times[2:]):,.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
