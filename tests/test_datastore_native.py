"""What `trtspec index` runs natively (kernels/text.py, csrc/text_index.cpp) equals the pure paths exactly: the
byte-level BPE encoder gives the HF fast tokenizer's ids, on random text over every class of character the
pre-tokenizer tells apart and on real files; the suffix array's sort gives the numpy prefix doubling's order."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from trtspec import kernels
from trtspec.kernels.text import byte_level_bpe
from trtspec.runtime.drafters.datastore import suffix_array
from trtspec.testing import make_tokenizer

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(kernels.load() != "native", reason="the native kernels could not be compiled here")

# every class GPT-2's pattern tells apart: ASCII letters, digits, the apostrophe and contractions' letters, spaces
# and the other ASCII whitespace, punctuation, control characters (0x1c-0x1f are not whitespace to it); non-ASCII
# letters, numbers (digits, superscripts, Roman numerals), whitespace (NBSP, NEL, ideographic space, line separator),
# combining marks, symbols and characters beyond the BMP
ALPHABET = (list("aZsterlvmd019'     \t\n\n\r\x0b\x0c.,;:()[]{}<>=+-*/#\"\\_")
            + ["\x00", "\x04", "\x1c", "\x1f", "\x7f"]
            + list("éЖ中ßﬁ٣²Ⅳ\xa0\x85\u3000\u2028\u0301\u20ac€😀𝕏"))


def _hf_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _random_texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(ALPHABET, size=int(rng.integers(0, 60)))) for _ in range(n)]


# "mixed": trained on text over ALPHABET, so its merges join characters of every class: a piece cut where HF's
# pre-tokenizer does not cut (or joined where it cuts) changes the ids
@pytest.fixture(scope="module", params=["stdlib-target", "tiny", "mixed"])
def tok(request):
    if request.param == "tiny":
        return make_tokenizer(vocab_size=320)
    if request.param == "mixed":
        return make_tokenizer(vocab_size=1500, corpus=_random_texts(1, 3000))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "models" / "stdlib-target")


def test_the_native_encoder_gives_the_hf_tokenizers_ids_on_random_text(tok):
    enc = byte_level_bpe(tok)
    assert enc is not None
    texts = _random_texts(0, 400) + ["it's we're they've I'm you'll he'd 'S 'Re", "  \n\n    def f(x):\n\treturn x  \n",
                                     " ", "\n", "", "a" * 700, " " * 300 + "x", "x</s>y <s> it's", "é" * 50 + "1" * 40]
    got = enc.encode(texts)
    assert [g.tolist() for g in got] == [_hf_ids(tok, t) for t in texts]
    assert all(g.dtype == np.int64 for g in got)


def test_the_native_encoder_gives_the_hf_tokenizers_ids_on_real_files(tok):
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib.glob("*.py"))[::12] + sorted((lib / "encodings").glob("*.py"))[::20]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    assert any(not t.isascii() for t in texts)
    got = byte_level_bpe(tok).encode(texts)
    for f, g, t in zip(files, got, texts):
        assert g.tolist() == _hf_ids(tok, t), f


def test_a_tokenizer_of_another_form_has_no_native_encoder():
    from tokenizers import pre_tokenizers

    tok = make_tokenizer(vocab_size=300)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert byte_level_bpe(tok) is None


@pytest.mark.parametrize("seed, vocab, depth", [(0, 3, 16), (1, 300, 16), (2, 70_000, 16), (3, 49_152, 5),
                                                (4, 2, 16)])
def test_the_native_suffix_array_equals_the_numpy_one(seed, vocab, depth):
    rng = np.random.default_rng(seed)
    # long repeats (a few blocks tiled), so groups survive every doubling round; 70,000 ids pack 3 to a key
    blocks = [rng.integers(0, vocab, size=int(rng.integers(1, 60))) for _ in range(5)]
    text = np.concatenate([blocks[i] for i in rng.integers(0, 5, size=400)] + [rng.integers(0, vocab, 300)])
    native, reference = suffix_array(text, depth), suffix_array(text, depth, native=False)
    assert native.dtype == reference.dtype == np.uint32
    np.testing.assert_array_equal(native, reference)
    assert suffix_array(text[:1], depth).tolist() == [0]


def _threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc")
def test_building_an_index_leaves_no_openmp_workers_behind(tmp_path):
    # the native encoder and sort run OpenMP regions on the calling thread; the pool they leave made every engine
    # call of the same process 5x slower (two pools spinning on 2 cores), so the index build lets it go
    import torch

    from trtspec.runtime.drafters.datastore import build_index

    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tok = make_tokenizer(vocab_size=320)
        for i in range(4):
            (tmp_path / "src" / f"m{i}.py").parent.mkdir(exist_ok=True)
            (tmp_path / "src" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # {'é' * i}\n" * 50)
        build_index([tmp_path / "src"], tmp_path / "first", tokenizer=tok)  # (the tokenizer's own pools start)
        kernels.release_openmp_workers()
        before = _threads()
        build_index([tmp_path / "src"], tmp_path / "second", tokenizer=tok)
        assert _threads() == before
    finally:
        torch.set_num_threads(before_threads)
