"""Tiny random-init models of every supported architecture, exported once per test session."""

from __future__ import annotations

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


__all__ = ["ARCHITECTURES", "MAX_BATCH", "S_MAX", "Server", "WrappedEngine", "hf_logits", "random_ids"]


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
