"""`trtspec bench` (bench()): trtspec side by side with what users run instead, on the same prompts, in one run;
and `trtspec bench-serve` (bench_serve()), a load test of any OpenAI-compatible server (server/loadgen.py).

Configurations (each over every prompt, batch 1, ``max_new_tokens`` each, repeated):
  hf               HF generate() with the target (PyTorch eager)
  hf_assisted      HF assisted generation, assistant_model = the draft
  hf_prompt_lookup HF prompt lookup decoding (greedy only)
  trtspec          trtspec target-only (drafter none)
  trtspec_k{k}     trtspec speculative with the draft model, fixed k
  trtspec_adaptive trtspec speculative with load-aware k (k_policy "load-aware", up to max k)
  trtspec_lookup   trtspec prompt lookup, fixed k = 4
  trtspec_self_k4  trtspec speculative with the target's own INT4 build as the draft (`--draft self`), fixed k
  trtspec_tree_k5x3            the draft's chain of 5 with its next 2 likeliest tokens at each depth, one tree
                               verify call (targets exported with --tree)
  trtspec_eagle3_k4, _tree_k5x3  an EAGLE-3 head (``eagle3``, an exported head) drafting chains / trees
  trtspec_medusa_tree16        Medusa heads (``medusa``), a 16-node tree
Reported: median tokens/s, speedups vs hf and vs trtspec measured in the same run, acceptance,
tokens per target call, the theoretical speedup E / (k c + v) from measured alpha and call costs,
and whether greedy outputs equal HF's and trtspec target-only's.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np

from .runtime import Generator
from .runtime.verify import expected_speedup, expected_tokens_per_call

log = logging.getLogger("trtspec.bench")


def bench(target, draft, prompts, *, hf_target=None, hf_draft=None, num_prompts: int | None = None,
          max_new_tokens: int = 128, repeats: int = 3, max_k: int = 8, temperatures=(0.0, 0.8), threads: int = 2,
          hf: bool = True, self_draft: bool = True, tree_width: int = 3, eagle3=None, medusa=None,
          output="benchmarks/results") -> dict:
    """Measure ``target`` and ``draft`` (engine directories) against HF's generate, assisted generation and prompt
    lookup (``hf``: their models default to the ones the engines were exported from) on the first ``num_prompts``
    of the JSON file ``prompts``: fixed k = 1..max_k and load-aware k, the self-draft (``self_draft``), trees of
    ``tree_width``, and an exported EAGLE-3 head or Medusa heads where given. Writes bench.json, bench.md and
    bench.png into ``output``; returns the results. ``trtspec bench`` is this call."""
    prompts = load_prompts(prompts)[:num_prompts]
    results = run_bench(target, draft, hf_target or source_model_dir(target), hf_draft or source_model_dir(draft),
                        prompts, max_new_tokens=max_new_tokens, ks=range(1, max_k + 1), repeats=repeats,
                        temperatures=temperatures, threads=threads, include_hf=hf, self_draft=self_draft,
                        tree_width=tree_width, eagle3=eagle3, medusa=medusa, log=log.info)
    write_outputs(results, Path(output))
    log.info("wrote %s/bench.json, bench.md, bench.png", output)
    return results


def bench_serve(url: str, *, model: str | None = None, prompts="models/heldout.json", max_tokens: int = 128,
                temperature: float = 0.0, concurrency=(1, 2, 4, 8, 16), rates=(), requests: int = 32,
                api_key: str | None = None, json_out=None) -> list[dict]:
    """Load-test the OpenAI-compatible server at ``url`` (its base, .../v1) with streamed completions of the
    ``prompts`` file: ``requests`` requests at each closed-loop client count of ``concurrency``, then at each
    open-loop Poisson rate of ``rates`` (requests/s). ``model``: default the server's first. Returns one row per
    load level (throughput, TTFT and inter-token latency percentiles, errors), also written to ``json_out``
    where given. ``trtspec bench-serve`` is this call."""
    import asyncio

    import httpx

    from .server.loadgen import run_load, summarize

    texts = load_prompts(prompts)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = model or httpx.get(url.rstrip("/") + "/models", headers=headers, timeout=30).json()["data"][0]["id"]
    results = []
    for kind, value in [("concurrency", c) for c in concurrency] + [("rate", r) for r in rates]:
        records, wall = asyncio.run(run_load(url, model, texts, max_tokens=max_tokens, num_requests=requests,
                                             temperature=temperature, api_key=api_key, **{kind: value}))
        row = {kind: value, **summarize(records, wall)}
        results.append(row)
        log.info(f"{kind} {value:>5}: {row['output_tok_s']:7.1f} tok/s, {row['requests_s']:.2f} req/s, TTFT p50 "
                 f"{row['ttft_p50_ms'] or 0:.0f} ms p99 {row['ttft_p99_ms'] or 0:.0f} ms, ITL p50 "
                 f"{row['itl_p50_ms'] or 0:.1f} ms p99 {row['itl_p99_ms'] or 0:.1f} ms, errors {row['errors']}")
    if json_out:
        Path(json_out).write_text(json.dumps({"url": url, "model": model, "max_tokens": max_tokens,
                                              "levels": results}, indent=1))
    return results


def load_prompts(path) -> list[str]:
    """Prompts from a JSON file: a list of strings or of {"prompt": ...}, or {"prompts": [...]}."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("prompts")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path} holds no prompts: expected a JSON list, or an object with a 'prompts' list")
    prompts = [p["prompt"] if isinstance(p, dict) else p for p in data]
    if not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"{path}: every prompt must be a non-empty string")
    return prompts


def source_model_dir(engine_dir) -> Path:
    """The HF model directory an engine (or export) was made from, as its manifests record it."""
    from .manifest import read_manifest

    manifest = read_manifest(engine_dir, verify=False)
    if "export_dir" in manifest.get("source", {}):
        manifest = read_manifest(manifest["source"]["export_dir"], verify=False)
    model_dir = Path(manifest.get("source", {}).get("model_dir", ""))
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"cannot find the HF model {engine_dir} was made from; pass --hf-target/--hf-draft")
    return model_dir


def measure_call_costs(engine, sizes, *, position: int = 128, repeats: int = 30, batch: int = 1,
                       warmup: int = 1, tree: bool = False) -> dict[int, float]:
    """Median seconds of one forward over T tokens per row, for each T in sizes (the same slots each time).
    ``tree``: each call verifies a bushy token tree of T nodes (every node has up to 3 children; a --tree target)."""
    from .engines.base import tree_positions

    costs = {}
    position = min(position, engine.max_seq_len - max(sizes) - 1)
    for t in sizes:
        ids = np.ones((batch, t), np.int64)
        if tree:
            mask, depth = tree_positions(np.tile([-1] + [(i - 1) // 3 for i in range(1, t)], (batch, 1)))
            kw, pos = {"tree_mask": mask}, position + depth
        else:
            kw, pos = {}, np.tile(np.arange(position, position + t), (batch, 1))
        for _ in range(warmup):  # warmup > 1 where a first call captures a CUDA graph
            engine.forward(ids, pos, **kw)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward(ids, pos, **kw)
            times.append(time.perf_counter() - t0)
        costs[t] = statistics.median(times)
    return costs


def _hf_runner(target_dir, draft_dir, threads, mode, k):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval() if mode == "assisted" else None

    def run(prompt, max_new_tokens, temperature, seed):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        kwargs = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id)
        if temperature > 0:
            torch.manual_seed(seed)
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if mode == "assisted":
            kwargs["assistant_model"] = draft
        elif mode == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = k
        with torch.no_grad():
            out = target.generate(ids, **kwargs)
        return out[0, ids.shape[1]:].tolist(), None

    return run


def _trtspec_runner(gen: Generator):
    def run(prompt, max_new_tokens, temperature, seed):
        out = gen.generate([prompt], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        return out[0].token_ids, out.stats  # batch stats: they carry the time split

    return run


def _measure(run, prompts, max_new_tokens, temperature, repeats):
    """Median tokens/s over repeats; outputs and summed stats of the first repeat."""
    rates, outputs = [], None
    totals = dict.fromkeys(("proposed", "accepted", "rejected", "target_calls", "new", "rounds", "draft_calls"), 0)
    totals.update(draft_s=0.0, verify_s=0.0)
    for rep in range(repeats):
        new, elapsed, outs = 0, 0.0, []
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            ids, stats = run(prompt, max_new_tokens, temperature, seed=1000 * rep + i)
            elapsed += time.perf_counter() - t0
            new += len(ids)
            outs.append(ids)
            if rep == 0 and stats is not None:
                totals["proposed"] += stats.proposed
                totals["accepted"] += stats.accepted
                totals["rejected"] += stats.rejected
                totals["target_calls"] += stats.target_calls
                totals["new"] += stats.new_tokens
                for key in ("rounds", "draft_calls", "draft_s", "verify_s"):
                    totals[key] += getattr(stats, key)
        rates.append(new / elapsed)
        outputs = outputs or outs
    row = {"tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates}
    if totals["target_calls"]:
        checked = totals["accepted"] + totals["rejected"]
        row.update(
            acceptance_rate=totals["accepted"] / totals["proposed"] if totals["proposed"] else None,
            alpha=totals["accepted"] / checked if checked else None,
            tokens_per_target_call=totals["new"] / totals["target_calls"],
            # costs as paid inside the generation loop (caches shared with the other model), per call
            verify_ms=totals["verify_s"] / totals["rounds"] * 1e3 if totals["rounds"] else None,
            draft_call_ms=totals["draft_s"] / totals["draft_calls"] * 1e3 if totals["draft_calls"] else None,
        )
    return row, outputs


def run_bench(
    target: str | Path,
    draft: str | Path,
    hf_target: str | Path,
    hf_draft: str | Path,
    prompts: list[str],
    *,
    max_new_tokens: int = 128,
    ks=range(1, 9),
    repeats: int = 3,
    temperatures=(0.0, 0.8),
    threads: int = 2,
    include_hf: bool = True,
    self_draft: bool = True,
    tree_width: int = 3,
    eagle3=None,
    medusa=None,
    log=print,
) -> dict:
    from .engines import load_engine
    from .errors import ArtifactError

    target_engine = load_engine(target, num_threads=threads)
    draft_engine = load_engine(draft, num_threads=threads)
    ks = list(ks)
    costs_target = measure_call_costs(target_engine, sorted({1, *[k + 1 for k in ks]}))
    costs_draft = measure_call_costs(draft_engine, [1, 2])
    c = costs_draft[1] / costs_target[1]
    log(f"target decode {costs_target[1] * 1e3:.2f} ms, draft decode {costs_draft[1] * 1e3:.2f} ms (c = {c:.3f})")
    configs = []
    if include_hf:
        configs += [("hf", None, lambda: _hf_runner(hf_target, hf_draft, threads, "plain", 0)),
                    ("hf_assisted", None, lambda: _hf_runner(hf_target, hf_draft, threads, "assisted", 0)),
                    ("hf_prompt_lookup", None, lambda: _hf_runner(hf_target, hf_draft, threads, "prompt_lookup", 4))]
    configs.append(("trtspec", 0, lambda: _trtspec_runner(Generator(target_engine))))
    for k in ks:
        configs.append((f"trtspec_k{k}", k, lambda k=k: _trtspec_runner(Generator(target_engine, draft_engine, num_draft_tokens=k, k_policy="fixed"))))
    configs.append(("trtspec_adaptive", None, lambda: _trtspec_runner(
        Generator(target_engine, draft_engine, num_draft_tokens=max(ks), k_policy="load-aware"))))
    configs.append(("trtspec_lookup", 4, lambda: _trtspec_runner(
        Generator(target_engine, drafter="prompt_lookup", num_draft_tokens=4, k_policy="fixed"))))
    k_tree = 5 if 5 in ks else max(ks)
    if getattr(target_engine, "tree_verify", False) and tree_width > 1:  # a --tree export: the draft's trees
        configs.append((f"trtspec_tree_k{k_tree}x{tree_width}", k_tree, lambda: _trtspec_runner(
            Generator(target_engine, draft_engine, num_draft_tokens=k_tree, k_policy="fixed", tree_width=tree_width))))
    else:
        log("no tree rows: the target was not exported with --tree")
    if eagle3 is not None:
        head = load_engine(eagle3, num_threads=threads)
        k_head = 4 if 4 in ks else max(ks)
        configs.append((f"trtspec_eagle3_k{k_head}", k_head, lambda: _trtspec_runner(
            Generator(target_engine, head, drafter="eagle3", num_draft_tokens=k_head, k_policy="fixed"))))
        if getattr(target_engine, "tree_verify", False) and tree_width > 1:
            configs.append((f"trtspec_eagle3_tree_k{k_tree}x{tree_width}", k_tree, lambda: _trtspec_runner(
                Generator(target_engine, head, drafter="eagle3", num_draft_tokens=k_tree, k_policy="fixed",
                          tree_width=tree_width))))
    if medusa is not None:
        configs.append(("trtspec_medusa_tree16", 4, lambda: _trtspec_runner(
            Generator(target_engine, medusa, drafter="medusa", num_draft_tokens=4, k_policy="fixed", tree_nodes=16))))
    if self_draft:  # the target's own INT4 build as its draft (`--draft self`), built once beside the target
        from .runtime.drafters.self_draft import self_draft as build_self_draft

        try:
            self_engine = load_engine(build_self_draft(target), num_threads=threads)
        except ArtifactError as e:
            log(f"no self-draft row: {e}")
        else:
            k_self = 4 if 4 in ks else max(ks)
            configs.append((f"trtspec_self_k{k_self}", k_self, lambda: _trtspec_runner(
                Generator(target_engine, self_engine, num_draft_tokens=k_self, k_policy="fixed"))))

    results = {"settings": {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "repeats": repeats,
                            "threads": threads, "ks": ks},
               "costs_ms": {"target": {t: v * 1e3 for t, v in costs_target.items()},
                            "draft": {t: v * 1e3 for t, v in costs_draft.items()}, "c": c},
               "runs": {}}
    for temperature in temperatures:
        table, outputs = {}, {}
        for name, k, make in configs:
            if temperature > 0 and name == "hf_prompt_lookup":
                continue  # HF prompt lookup is greedy-only
            run = make()
            log(f"T={temperature} {name} ...")
            row, outs = _measure(run, prompts, max_new_tokens, temperature, repeats)
            if k and name != "trtspec_lookup" and row.get("alpha") is not None:
                # S = E / (k c + v) with alpha and the per-call costs measured in this run's loops, relative
                # to a decode call of the target-only run
                decode_ms = table["trtspec"]["verify_ms"]
                c_loop, v = row["draft_call_ms"] / decode_ms, row["verify_ms"] / decode_ms
                row.update(k=k, c=c_loop, v=v, expected_tokens_per_call=expected_tokens_per_call(row["alpha"], k),
                           theoretical_speedup=expected_speedup(row["alpha"], k, c_loop, v))
            table[name], outputs[name] = row, outs
            log(f"    {row['tokens_per_s']:.1f} tok/s")
        for name, row in table.items():
            for base in ("hf", "trtspec"):
                if base in table:
                    row[f"speedup_vs_{base}"] = row["tokens_per_s"] / table[base]["tokens_per_s"]
            if temperature == 0:
                for base in ("hf", "trtspec"):
                    if base in outputs:
                        row[f"greedy_equals_{base}"] = outputs[name] == outputs[base]
            if "theoretical_speedup" in row:
                row["measured_over_theoretical"] = row["speedup_vs_trtspec"] / row["theoretical_speedup"]
        results["runs"][str(temperature)] = table
    return results


def markdown_table(results: dict) -> str:
    lines = []
    for temperature, table in results["runs"].items():
        lines += [f"\n**temperature {temperature}**\n",
                  "| config | tok/s | vs HF | vs trtspec | acceptance | alpha | tokens/target call | theoretical | measured/theoretical | greedy = HF | greedy = trtspec |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in table.items():
            def f(key, fmt="{:.2f}"):
                value = row.get(key)
                if value is None:
                    return "–"
                if isinstance(value, bool):
                    return "yes" if value else "**no**"
                return fmt.format(value)
            lines.append(f"| {name} | {f('tokens_per_s', '{:.1f}')} | {f('speedup_vs_hf', '{:.2f}x')} | {f('speedup_vs_trtspec', '{:.2f}x')} | "
                         f"{f('acceptance_rate')} | {f('alpha')} | {f('tokens_per_target_call')} | "
                         f"{f('theoretical_speedup')} | {f('measured_over_theoretical')} | {f('greedy_equals_hf')} | "
                         f"{f('greedy_equals_trtspec')} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for temperature, table in results["runs"].items():
        ks = [row["k"] for name, row in table.items() if name.startswith("trtspec_k")]
        rows = [row for name, row in table.items() if name.startswith("trtspec_k")]
        ax1.plot(ks, [r["speedup_vs_trtspec"] for r in rows], "o-", label=f"measured, T={temperature}")
        ax1.plot(ks, [r["theoretical_speedup"] for r in rows], "x--", label=f"theoretical, T={temperature}")
        ax2.plot(ks, [r["alpha"] for r in rows], "o-", label=f"alpha, T={temperature}")
        ax2.plot(ks, [r["acceptance_rate"] for r in rows], "x--", label=f"accepted/proposed, T={temperature}")
    ax1.axhline(1.0, color="gray", lw=0.5)
    ax1.set(xlabel="draft tokens k", ylabel="speedup over trtspec target-only", title="speedup vs k")
    ax2.set(xlabel="draft tokens k", ylabel="rate", title="acceptance vs k", ylim=(0, 1))
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2))
    (out_dir / "bench.md").write_text(markdown_table(results))
    plot(results, out_dir / "bench.png")
