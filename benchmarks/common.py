"""Shared pieces of the benchmarks: models made offline, the machine's memory bandwidth, timing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "models" / "bench"


def random_llama(out_dir: Path, *, seed: int = 0, hidden: int = 512, layers: int = 8, heads: int = 8,
                 kv_heads: int = 4, intermediate: int = 1376, vocab: int = 8000, tied: bool = False) -> Path:
    """A random-init Llama (default ~31M parameters) with the tiny test tokenizer, saved as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trtspec.testing import make_tokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def memory_bandwidth_gbs(mbytes: int = 256, repeats: int = 7, torch_threads: int | None = None) -> float:
    """Read bandwidth: median of sums over a buffer far larger than the caches (numpy, 1 thread; or torch)."""
    if torch_threads is None:
        buf = np.ones(mbytes * (1 << 20) // 4, dtype=np.float32)
    else:
        import torch

        torch.set_num_threads(torch_threads)
        buf = torch.ones(mbytes * (1 << 20) // 4)
    buf.sum()
    return mbytes * (1 << 20) / median_time(buf.sum, repeats) / 1e9


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def save_results(out: Path, res: dict, table: str):
    """``out``.json (everything measured) and ``out``.md (the table), printed too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(table)
    print(table)


def weights_digest(hf_dir: Path) -> str:
    """sha256 of an HF directory's weight files: what decides whether artifacts made from it are still its."""
    h = hashlib.sha256()
    for f in sorted(Path(hf_dir).glob("*.safetensors")) + sorted(Path(hf_dir).glob("*.bin")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def made_from(artifact: Path, hf_dir: Path) -> Path:
    """``artifact``, a cached work directory made from ``hf_dir``: removed (to be made again) when it was made
    from other weights. The bundled models get retrained, and their config alone does not say so."""
    stamp = artifact.with_name(artifact.name + ".weights-sha256")
    digest = weights_digest(hf_dir)
    if artifact.exists() and (not stamp.is_file() or stamp.read_text() != digest):
        shutil.rmtree(artifact)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(digest)
    return artifact


@contextlib.contextmanager
def sources(baseline: str | None):
    """{label: checkout} to run in the same rounds: this tree, and ``baseline`` (a git revision) checked out into a
    temporary git worktree, removed on the way out."""
    found = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        if baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), baseline], check=True,
                           capture_output=True)
            found[f"baseline {baseline}"] = base
        try:
            yield found
        finally:
            if baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                               capture_output=True)


# What a process needs to run as an AVX2-only CPU would on one with AVX-512 (the kernels' --path avx2 stand-in):
# ATen's own kernels on AVX2, and a torch engine built meanwhile compiled for x86-64-v3 (AVX2, FMA, F16C), which
# inductor's code for AVX-512 is not. The engines measured must be built so too (docs/building.md, "An engine for
# other CPUs"); avx2_built says whether one was.
AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"}
AVX2_FAMILY = ("avx2", "avxvnni")


def compiled_for(engine: Path) -> str | None:
    """The vector ISA the torch engine in ``engine`` was compiled for (its manifest's build.cpu_isa), if recorded."""
    return json.loads((Path(engine) / "manifest.json").read_text())["build"].get("cpu_isa")


def avx2_built(engine: Path) -> bool:
    """Whether the torch engine in ``engine`` was compiled for AVX2 vectors."""
    return compiled_for(engine) == "avx2"
