"""Train the bundled target/draft pair on the Python standard library's source, offline and reproducibly.

    python benchmarks/train_pair.py --out models/       # ~5 h on 2 cores; stopped, it resumes from .train/

Writes models/stdlib-target, models/stdlib-draft (HF directories, fp16 safetensors, shared tokenizer),
models/heldout.json (the held-out file list and benchmark prompts) and models/MODEL_CARD.md.

Data: every .py file of the running interpreter's standard library (site-packages excluded). A file is
held out for evaluation when sha256(relative path) mod 20 == 0 (~5 %); nothing is trained on those.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
VOCAB = 8192
SEQ = 256
BATCH = 16

TARGET = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=1536, tie_word_embeddings=False)
DRAFT = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=768, tie_word_embeddings=True)
TARGET_STEPS, TARGET_LR = 2400, 1.5e-3
DRAFT_STEPS, DRAFT_LR = 1200, 3e-3
# --stage unlikelihood (an experiment, not part of the committed weights): the trained target fine-tuned
# against its own greedy loops
UL_STEPS, UL_LR, UL_WEIGHT, UL_PREFIX, UL_NEW = 200, 1e-4, 1.0, 64, 96


def stdlib_files() -> tuple[list[Path], list[Path], Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    held = [p for p in files if int(hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest(), 16) % 20 == 0]
    held_set = set(held)
    return [p for p in files if p not in held_set], held, root


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read(p) for p in files), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def encode(tokenizer, files: list[Path]) -> np.ndarray:
    # every file as <s> text </s>, concatenated: [N] uint16
    ids = []
    for batch_start in range(0, len(files), 64):
        texts = [read(p) for p in files[batch_start : batch_start + 64]]
        for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.extend([1, *enc, 2])
    return np.asarray(ids, dtype=np.uint16)


def make_model(spec: dict, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, rope_theta=10000.0, **spec)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def perplexity(model, data: np.ndarray, max_tokens: int = 65_536) -> float:
    import torch

    n = min(data.size - 1, max_tokens) // SEQ * SEQ
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, n, SEQ * BATCH):
            chunk = data[s : min(s + SEQ * BATCH, n)].astype(np.int64).reshape(-1, SEQ)
            x = torch.from_numpy(chunk)
            loss = model(input_ids=x, labels=x).loss
            total += loss.item() * x.numel()
            count += x.numel()
    return math.exp(total / count)


def benchmark_prompts(held: list[Path], root: Path, tokenizer, n: int = 24, prompt_tokens: int = 96) -> list[dict]:
    """A fixed prompt set: lines from a third into each held-out file, cut at a line end near prompt_tokens
    (the model writes that line's newline itself)."""
    prompts = []
    for p in held:
        text = read(p)
        lines = text.splitlines(keepends=True)
        acc = ""
        for line in lines[len(lines) // 3 :]:
            if len(tokenizer(acc + line)["input_ids"]) > prompt_tokens:
                break
            acc += line
        if len(tokenizer(acc)["input_ids"]) >= prompt_tokens // 2 and len(text) > 3 * len(acc):
            # without the last line's newline: this byte-level BPE writes a newline and the next line's
            # indentation as one token, so a prompt ending in a bare newline token says "column 0 next"
            prompts.append({"file": p.relative_to(root).as_posix(), "prompt": acc.removesuffix("\n")})
        if len(prompts) == n:
            break
    return prompts


def load_data(work: Path):
    """Tokenizer and token streams, cached in the work directory (the tokenizer is trained once, there)."""
    from transformers import AutoTokenizer

    train_files, held, root = stdlib_files()
    tok_dir = work / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tokenizer = train_tokenizer(train_files)
        tokenizer.save_pretrained(tok_dir)
    cache = work / "tokens.npz"
    if cache.exists():
        arrays = np.load(cache)
        train_ids, held_ids = arrays["train"], arrays["held"]
    else:
        train_ids, held_ids = encode(tokenizer, train_files), encode(tokenizer, held)
        np.savez(work / "tokens.tmp.npz", train=train_ids, held=held_ids)
        (work / "tokens.tmp.npz").replace(cache)
    return tokenizer, train_ids, held_ids, train_files, held, root


def train_target(train_ids: np.ndarray, work: Path, steps: int):
    from trtspec.training import TrainConfig, TrainLoop, random_windows

    model = make_model(TARGET, seed=0)
    cfg = TrainConfig(steps=steps, batch=BATCH, seq=SEQ, lr=TARGET_LR, seed=0, checkpoint_every=40,
                      extra={"model": TARGET, "vocab": VOCAB, "data_tokens": int(train_ids.size)})
    loop = TrainLoop(model, cfg, work / "target", name="target")

    def batch(step):
        import torch
        return torch.from_numpy(random_windows(train_ids, BATCH, SEQ, 0, step))

    def loss(model, w, step):
        import torch.nn.functional as F
        logits = model(input_ids=w[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))

    seconds = loop.run(batch, loss)
    return model, loop, seconds


def unlikelihood_target(tokenizer, train_ids: np.ndarray, held_ids: np.ndarray, work: Path) -> dict:
    """Fine-tune the trained target (.train/target) against greedy repetition; writes work/target-ul/model.

    Sequence-level unlikelihood training (Welleck et al. 2019), per step: cross-entropy on 8 windows of the
    training text, plus -log(1 - p(token)) on the tokens of the model's own greedy continuations (UL_NEW
    tokens after UL_PREFIX tokens of training text, regenerated with the current weights every step) that lie
    in a line repeating an earlier generated line (trtspec.training.repeated_line_mask). Resumable like the
    other stages. Not part of --stage all: the committed target was not trained this way (models/MODEL_CARD.md
    has what 200 steps did); to adopt it, copy the model to models/stdlib-target and distil the draft again.
    """
    import torch
    import torch.nn.functional as F

    from trtspec.training import TrainConfig, TrainLoop, random_windows, repeated_line_mask

    model = make_model(TARGET, seed=0)
    model.load_state_dict(torch.load(work / "target" / "checkpoint.pt", map_location="cpu", weights_only=False)["model"])
    half = BATCH // 2
    pieces = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
    cfg = TrainConfig(steps=UL_STEPS, batch=BATCH, seq=SEQ, lr=UL_LR, seed=2, checkpoint_every=25, log_every=10,
                      extra={"stage": "unlikelihood", "weight": UL_WEIGHT, "prefix": UL_PREFIX, "new": UL_NEW})
    loop = TrainLoop(model, cfg, work / "target-ul", name="target-ul")

    def batch(step):
        text = torch.from_numpy(random_windows(train_ids, half, SEQ, 2, step))
        prefixes = torch.from_numpy(random_windows(train_ids, half, UL_PREFIX - 1, 3, step))
        with torch.no_grad():
            gen = model.generate(input_ids=prefixes, attention_mask=torch.ones_like(prefixes), do_sample=False,
                                 max_new_tokens=UL_NEW, min_new_tokens=UL_NEW, pad_token_id=0)
        mask = np.stack([repeated_line_mask([pieces[t] for t in row], UL_PREFIX) for row in gen.tolist()])
        return text, gen, torch.from_numpy(mask)

    def loss(model, b, step):
        text, gen, mask = b
        logits = model(input_ids=text[:, :-1]).logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), text[:, 1:].reshape(-1))
        p = torch.log_softmax(model(input_ids=gen[:, :-1]).logits.float(), -1).gather(-1, gen[:, 1:, None])[..., 0].exp()
        ul = -torch.log((1 - p).clamp_min(1e-5)) * mask[:, 1:]
        return ce + UL_WEIGHT * ul.sum() / (half * UL_NEW)

    seconds = loop.run(batch, loss)
    ppl = perplexity(model, held_ids)
    out = work / "target-ul" / "model"
    model.to(torch.float16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"[target-ul] held-out perplexity {ppl:.2f}; wrote {out}", flush=True)
    return {"steps": UL_STEPS, "peak_lr": UL_LR, "weight": UL_WEIGHT, "train_minutes": seconds / 60,
            "heldout_perplexity": ppl}


def distill_drafts(out: Path, work: Path, train_files: list[Path], held: list[Path]) -> dict:
    """The bundled draft, distilled from the trained target with `trtspec distill`; and, for comparison, the same
    draft trained on the same budget without distillation (kd_weight 0: cross-entropy on the text)."""
    import shutil

    from trtspec.distill import distill

    shape = dict(layers=DRAFT["num_hidden_layers"], hidden=DRAFT["hidden_size"], heads=DRAFT["num_attention_heads"],
                 kv_heads=DRAFT["num_key_value_heads"], intermediate=DRAFT["intermediate_size"])
    common = dict(heldout=held, steps=DRAFT_STEPS, lr=DRAFT_LR, batch=BATCH, seq=SEQ, seed=1, dtype="float16",
                  eval_prompts=24, **shape)
    reports = {}
    for name, kd_weight in (("draft", 1.0), ("draft_without_distillation", 0.0)):
        staged = work / name
        if not (staged / "distill_report.json").is_file():
            distill(out / "stdlib-target", staged, train_files, kd_weight=kd_weight, **common)
        reports[name] = json.loads((staged / "distill_report.json").read_text())
    shutil.rmtree(out / "stdlib-draft", ignore_errors=True)
    shutil.copytree(work / "draft", out / "stdlib-draft")
    (out / "stdlib-draft" / "distill_report.json").unlink()
    return reports


def main():
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="models", type=Path)
    parser.add_argument("--work", default=".train", type=Path,
                        help="checkpoints and the token cache; a stopped run resumes from here")
    parser.add_argument("--stage", choices=["target", "draft", "all", "unlikelihood"], default="all",
                        help="unlikelihood: the experiment of unlikelihood_target (not part of all)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tokenizer, train_ids, held_ids, train_files, held, root = load_data(args.work)
    print(f"{len(train_files)} training files, {len(held)} held out; tokenizer {len(tokenizer)} tokens; "
          f"{train_ids.size} training tokens, {held_ids.size} held out", flush=True)
    report_path = args.out / "train_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report["data"] = {"stdlib": str(root), "train_files": len(train_files), "heldout_files": len(held),
                      "train_tokens": int(train_ids.size), "heldout_tokens": int(held_ids.size)}
    if args.stage in ("target", "all"):
        model, loop, seconds = train_target(train_ids, args.work, TARGET_STEPS)
        ppl = perplexity(model, held_ids)
        out = args.out / "stdlib-target"
        model.to(torch.float16).save_pretrained(out)
        tokenizer.save_pretrained(out)
        report["target"] = {"parameters": sum(p.numel() for p in model.parameters()), "config": TARGET,
                            "steps": TARGET_STEPS, "tokens_seen": TARGET_STEPS * BATCH * SEQ, "peak_lr": TARGET_LR,
                            "bf16_autocast": loop.autocast, "train_minutes": seconds / 60,
                            "heldout_perplexity": ppl, "loss_curve": loop.history}
        print(f"[target] held-out perplexity {ppl:.2f}", flush=True)
        prompts = benchmark_prompts(held, root, tokenizer)
        (args.out / "heldout.json").write_text(json.dumps(
            {"rule": "sha256(path relative to the stdlib) mod 20 == 0",
             "files": [p.relative_to(root).as_posix() for p in held], "prompts": prompts}, indent=1))
        report_path.write_text(json.dumps(report, indent=2))
    if args.stage == "unlikelihood":
        result = unlikelihood_target(tokenizer, train_ids, held_ids, args.work)
        (args.work / "target-ul" / "report.json").write_text(json.dumps(result, indent=2))
        return
    if args.stage in ("draft", "all"):
        report.update(distill_drafts(args.out, args.work, train_files, held))
        report_path.write_text(json.dumps(report, indent=2))
    report["total_minutes"] = (time.perf_counter() - t_start) / 60
    report_path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
