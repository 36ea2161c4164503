"""`trtspec bench` on tiny engines: every row's greedy output equals target-only's, the self-draft row included."""

from __future__ import annotations

from trtspec.bench import markdown_table, run_bench


def test_bench_rows_are_lossless_and_include_the_self_draft(built, exported):
    target = built("llama")
    draft = exported("llama", seed=1)  # another random model with the same tokenizer
    res = run_bench(target, draft, None, None, ["def add(a, b):", "import os\n"], max_new_tokens=12, ks=[1, 2],
                    repeats=1, temperatures=(0.0,), include_hf=False, log=lambda m: None)
    table = res["runs"]["0.0"]
    assert set(table) == {"trtspec", "trtspec_k1", "trtspec_k2", "trtspec_adaptive", "trtspec_lookup",
                          "trtspec_self_k2"}
    for name, row in table.items():
        assert row["greedy_equals_trtspec"], name
    # the self-draft is the target in INT4: it agrees with the target far more often than a random draft
    assert table["trtspec_self_k2"]["alpha"] > table["trtspec_k2"]["alpha"]
    assert table["trtspec_self_k2"]["theoretical_speedup"] > 0
    assert "trtspec_self_k2" in markdown_table(res)
