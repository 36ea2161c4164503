"""Tiny random-init models of every supported architecture, exported once per test session."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from quant_reference import CALIB
from trtspec.quantization import quantize
from trtspec.testing import ARCHITECTURES, make_tiny_model

S_MAX = 64
MAX_BATCH = 3


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    cache = {}

    def get(arch: str, seed: int = 0):
        key = (arch, seed)
        if key not in cache:
            cache[key] = make_tiny_model(arch, tmp_path_factory.mktemp(f"hf-{arch}-{seed}"), seed=seed)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory, model_dir):
    from trtspec import export

    cache = {}

    def get(arch: str, seed: int = 0, **options):
        key = (arch, seed, tuple(sorted(options.items())))
        if key not in cache:
            opts = {"max_seq_len": S_MAX, "max_batch": MAX_BATCH, **options}
            cache[key] = export(model_dir(arch, seed), tmp_path_factory.mktemp(f"export-{arch}-{seed}") / "a", **opts)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def quantized(exported, tmp_path_factory):
    cache = {}

    def get(arch: str, mode: str, **options):
        key = (arch, mode, tuple(sorted(options.items())))
        if key not in cache:
            if mode in CALIB:
                options.setdefault("calib_samples", CALIB[mode])
            if mode.startswith("int4"):
                options.setdefault("block_size", 32)
            cache[key] = quantize(exported(arch), tmp_path_factory.mktemp(f"q-{arch}-{mode}") / "a", mode=mode, **options)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def built(tmp_path_factory, exported):
    """The onnxruntime engine built from ``exported(arch)``: fused (the default build) or plain (--no-fusion)."""
    from trtspec import build

    cache = {}

    def get(arch: str, fusion: bool = True, **options):
        key = (arch, fusion, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = build(exported(arch, **options), tmp_path_factory.mktemp(f"engine-{arch}") / "e", fusion=fusion)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def step_engine(exported, built):
    """A step engine for an architecture in one of its forms: "export" (the portable graph run as is),
    "plain" (built without fusion) or "fused" (the default onnxruntime build)."""
    from trtspec import load_engine

    def get(arch: str, form: str):
        path = {"export": lambda: exported(arch), "plain": lambda: built(arch, fusion=False),
                "fused": lambda: built(arch)}[form]()
        return load_engine(path)

    return get


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path).eval()
        return cache[path]

    return get


def hf_logits(model, ids) -> np.ndarray:
    """The HF model's own forward over one full sequence: logits [T, V]."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]).logits[0].float().numpy()


def random_ids(n: int, seed: int = 0, vocab: int = 300) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=n)


class WrappedEngine:
    """An engine seen through a hook: ``before(ids, pos, first_row)`` runs ahead of each forward (to record
    calls, slow them down or make them fail); everything else is the engine's own."""

    def __init__(self, engine, before):
        self.engine, self.before = engine, before

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward(self, ids, pos, first_row=0, **kw):
        self.before(ids, pos, first_row)
        return self.engine.forward(ids, pos, first_row=first_row, **kw)


__all__ = ["ARCHITECTURES", "BATCHING", "MAX_BATCH", "S_MAX", "TREE", "Server", "WrappedEngine", "hf_logits",
           "make_prompt", "random_ids", "released_head"]


@pytest.fixture(scope="session")
def perturbed_export(tmp_path_factory, model_dir):
    """A draft that often agrees with its target: the target's weights plus noise, exported like it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtspec import export

    cache = {}

    def get(arch: str, noise: float, **options):
        key = (arch, noise, tuple(sorted(options.items())))
        if key not in cache:
            import torch

            src = model_dir(arch)
            out = tmp_path_factory.mktemp(f"hf-{arch}-noisy")
            model = AutoModelForCausalLM.from_pretrained(src)
            gen = torch.Generator().manual_seed(123)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
            model.save_pretrained(out)
            AutoTokenizer.from_pretrained(src).save_pretrained(out)
            opts = {"max_seq_len": S_MAX, "max_batch": MAX_BATCH, **options}
            cache[key] = export(out, tmp_path_factory.mktemp(f"export-{arch}-noisy") / "a", **opts)
        return cache[key]

    return get


ARCH = "llama-gqa-rope3"  # the serving tests' model
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`trtspec serve`'s uvicorn server (server.run.make_server) in a thread on a free port of 127.0.0.1;
    ``server.drain()`` drains it as SIGTERM would."""

    def __init__(self, app, **options):
        from trtspec.server.run import make_server

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, host="127.0.0.1", port=self.port, **options)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


@pytest.fixture(scope="session")
def chat_export(tmp_path_factory):
    """A tiny model whose tokenizer has a chat template, exported with 128 positions and 4 rows."""
    from transformers import AutoTokenizer

    from trtspec import export

    src = make_tiny_model(ARCH, tmp_path_factory.mktemp("hf-chat"), seed=0)
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(src)
    return export(src, tmp_path_factory.mktemp("export-chat") / "a", max_seq_len=128, max_batch=4)


# -- continuous batching (test_scheduler, test_submission, test_worker, test_draft_model) ---------------------------

BATCHING = {"max_seq_len": 256, "max_batch": 4}  # the options of these tests' target and draft exports
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def make_prompt(i: int, words: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, size=words))


@pytest.fixture(scope="module")
def target(exported):
    """The continuous-batching tests' target engine, one per module (a module testing other engines defines its own)."""
    from trtspec import load_engine

    return load_engine(exported(ARCH, **BATCHING))


@pytest.fixture(scope="module")
def draft(perturbed_export):
    """Their draft: the target's weights perturbed (acceptance well below 1), one per module."""
    from trtspec import load_engine

    return load_engine(perturbed_export(ARCH, 0.3, **BATCHING))


@pytest.fixture(scope="module")
def alone(target):
    """A request's output run alone: plain target decoding, one request at a time (on the module's ``target``)."""
    from trtspec import Generator

    gen = Generator(target)
    cache = {}

    def get(prompt, **params):
        key = (prompt, repr(sorted(params.items())))
        if key not in cache:
            cache[key] = gen.generate(prompt, **params)
        return cache[key]

    return get


# the tree tests' targets (test_tree, test_trees): a --tree export with the features a head reads
FEATURES = "low,mid,high,last"
TREE = dict(tree=True, hidden_states=FEATURES, ring_cache=False)


@pytest.fixture(scope="session")
def tree_engine(exported, built, model_dir):
    import trtspec
    from trtspec import load_engine

    compiled = {}

    def get(arch: str, form: str = "fused"):
        # form: "export" (the portable graph), "plain" / "fused" (onnxruntime builds), "torch" / "torch-inductor"
        # (the torch backend, eager or compiled, with the same tree input and features output)
        if form.startswith("torch"):
            if (arch, form) not in compiled:
                compiled[arch, form] = trtspec.compile(model_dir(arch), max_seq_len=S_MAX, max_batch=MAX_BATCH,
                                                       backend=form.partition("-")[2] or "eager", tree=True,
                                                       hidden_states=FEATURES)
            engine = compiled[arch, form]
            engine.reset()
            return engine
        path = exported(arch, **TREE) if form == "export" else built(arch, fusion=form == "fused", **TREE)
        return load_engine(path)

    return get


# -- EAGLE-3 heads (test_heads, test_eagle3) ------------------------------------------------------------------------

def released_head(out, target_dir, *, draft_vocab=200, seed=0):
    """A random EAGLE-3 head written exactly as the EAGLE authors publish theirs: config.json (architecture
    LlamaForCausalLMEagle3, draft_vocab_size) and pytorch_model.bin with fc / midlayer.* / norm / lm_head / d2t /
    t2d, no embedding (it is the target's)."""
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target_dir)
    h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // nh
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * (shape[-1] ** -0.5)

    ids = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab]).values
    state = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(nh * d, 2 * h), "midlayer.self_attn.k_proj.weight": w(nkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv * d, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, nh * d),
        "midlayer.mlp.gate_proj.weight": w(96, h), "midlayer.mlp.up_proj.weight": w(96, h),
        "midlayer.mlp.down_proj.weight": w(h, 96),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "norm.weight": torch.ones(h), "lm_head.weight": w(draft_vocab, h) * 8,
        "d2t": ids - torch.arange(draft_vocab), "t2d": torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill(0, ids, True),
    }
    out.mkdir(parents=True)
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": 96,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": draft_vocab, "max_position_embeddings": 2048,
        "hidden_act": "silu", "torch_dtype": "float32"}))
    return out


@pytest.fixture(scope="session")
def eagle(tmp_path_factory, exported, built, model_dir):
    """(a built target with features, the released head exported for it, the released head's directory)"""
    from trtspec.heads.export import export_head

    target = built(ARCH, tree=True, hidden_states="low,mid,high,last")  # (more layers than the head reads)
    tmp = tmp_path_factory.mktemp("eagle3")
    head_dir = released_head(tmp / "released", model_dir(ARCH))
    head = export_head(head_dir, tmp / "head", target=target)
    return target, head, head_dir
