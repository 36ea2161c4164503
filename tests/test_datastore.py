"""The datastore (runtime/drafters/datastore.py): an index of a corpus that suffix decoding drafts from. Its suffix
array, its lookups, its refusals (another vocabulary, a truncated or foreign file), its incremental rebuild, and
speculation over it: drafts that come from the index, output equal to the target alone, one index shared by
concurrent requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trtspec import ArtifactError, Generator, Scheduler, index, load_engine
from trtspec.runtime.drafters.datastore import DEPTH, Datastore, suffix_array, tokenizer_fingerprint
from trtspec.testing import make_tokenizer

ARCH = "llama-gqa-rope3"
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "The quick brown fox jumps over the lazy dog. The quick",
           "import os"]


@pytest.mark.parametrize("seed, vocab", [(0, 3), (1, 50), (2, 60_000), (3, 2)])
def test_the_suffix_array_sorts_every_suffix_by_its_first_depth_tokens(seed, vocab):
    rng = np.random.default_rng(seed)
    # long repeats (a few distinct blocks tiled) as code has, so ranks need every doubling round
    blocks = [rng.integers(0, vocab, size=int(rng.integers(1, 40))) for _ in range(4)]
    text = np.concatenate([blocks[i] for i in rng.integers(0, 4, size=60)])
    sa = suffix_array(text)
    assert sorted(sa.tolist()) == list(range(text.size))  # a permutation
    keys = [tuple(text[p : p + DEPTH].tolist()) for p in sa.tolist()]  # (a shorter prefix sorts first, as bytes do)
    assert keys == sorted(keys)


@pytest.fixture(scope="module")
def engine_dir(exported):
    return exported(ARCH)


@pytest.fixture(scope="module")
def tokenizer(engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_dir / "tokenizer")


def test_a_lookup_finds_what_followed_the_longest_match_and_how_often(tmp_path, engine_dir, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("zeta kappa lambda = 1\nzeta kappa lambda = 1\nzeta kappa lambda = 1\n")
    (corpus / "b.py").write_text("zeta kappa lambda += 2\nomega psi chi phi upsilon tau sigma rho\n")
    (corpus / "skip.bin").write_bytes(b"\xff\xfe not text")
    store = Datastore(index([corpus], tmp_path / "idx", tokenizer=engine_dir))
    assert [f["path"].rsplit("/", 1)[1] for f in store.manifest["sources"]] == ["a.py", "b.py"]
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    # one continuation in the whole corpus: the index gives exactly it, after the longest match
    tail = ids("omega psi chi")
    m, found = store.find(tail, 6)
    rest = ids("omega psi chi phi upsilon tau sigma rho\n")[len(tail):]
    assert m == len(tail) and found == [tuple(rest[:6])]
    # an id the index cannot hold (a model's padded vocabulary) ends what can match; what follows it still does
    assert store.find([store.sep + 5, *tail], 6) == (m, found)
    assert store.find([*tail, store.sep], 6) == (0, [])

    # four occurrences of "zeta kappa lambda": three go on " = 1", one " += 2" (frequency decides the shares)
    m, found = store.find(ids("zeta kappa lambda"), 2)
    assert m == len(ids("zeta kappa lambda"))
    assert sorted(found) == sorted([tuple(ids(" = 1")[:2])] * 3 + [tuple(ids(" += 2")[:2])])
    assert store.occurrences(ids("zeta kappa lambda")) == 4

    # no continuation crosses a document's end (b.py's text ends there), and text the corpus lacks matches nothing
    assert store.find(ids("sigma rho\n"), 8) == (0, [])
    assert store.find(ids("unrelated words never indexed"), 4) == (0, [])


def test_an_index_of_another_vocabulary_is_refused(tmp_path, engine_dir):
    (tmp_path / "a.py").write_text("def f(x):\n    return x\n" * 4)
    foreign = make_tokenizer(vocab_size=300)
    assert tokenizer_fingerprint(foreign) != tokenizer_fingerprint(make_tokenizer())
    idx = index([tmp_path / "a.py"], tmp_path / "idx", tokenizer=foreign)
    with pytest.raises(ArtifactError, match="built with another tokenizer.*trtspec index"):
        Generator(load_engine(engine_dir), datastore=idx)


def test_a_truncated_missing_or_foreign_index_is_refused(tmp_path, engine_dir):
    (tmp_path / "a.py").write_text("import os\nimport sys\n" * 8)
    idx = index([tmp_path / "a.py"], tmp_path / "idx", tokenizer=engine_dir)
    sa = idx / "sa.bin"
    whole = sa.read_bytes()
    sa.write_bytes(whole[:-4])
    with pytest.raises(ArtifactError, match="truncated"):
        Datastore(idx)
    sa.write_bytes(np.full(len(whole) // 4, 2**31, "<u4").tobytes())  # the right size, nonsense inside
    with pytest.raises(ArtifactError, match="corrupt"):
        Datastore(idx)
    sa.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        Datastore(idx)
    with pytest.raises(ArtifactError, match="not a datastore index"):
        Datastore(tmp_path)
    with pytest.raises(ArtifactError, match="not a datastore index"):
        Datastore(engine_dir)
    # a directory that is not an index is never overwritten
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ArtifactError, match="refusing to overwrite"):
        index([tmp_path / "a.py"], tmp_path / "mine", tokenizer=engine_dir)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_rebuild_tokenizes_only_the_files_that_changed_and_equals_a_fresh_build(tmp_path, engine_dir):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (i + 1))
    idx = index([src], tmp_path / "idx", tokenizer=engine_dir)
    (src / "m2.py").write_text("def changed():\n    pass\n")
    index([src], idx, tokenizer=engine_dir)
    assert Datastore(idx).manifest["build"]["files_reused"] == 3
    fresh = index([src], tmp_path / "fresh", tokenizer=engine_dir)
    for name in ("text.bin", "sa.bin"):
        assert (idx / name).read_bytes() == (fresh / name).read_bytes()


@pytest.fixture(scope="module")
def plain(engine_dir):
    return load_engine(engine_dir)


@pytest.fixture(scope="module")
def reference(plain):
    return [r.token_ids for r in Generator(plain).generate(PROMPTS, max_new_tokens=40)]


@pytest.fixture(scope="module")
def answers_index(tmp_path_factory, plain, reference, engine_dir):
    """An index of the target's own earlier answers (a .jsonl of past outputs, logged as token ids: the random
    model's bytes are not text that tokenizes back to them): what a service that indexes its answers drafts from."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_dir / "tokenizer")
    out = tmp_path_factory.mktemp("answers")
    lines = [json.dumps({"token_ids": tok(p)["input_ids"] + ids}) for p, ids in zip(PROMPTS, reference)]
    (out / "answers.jsonl").write_text("\n".join(lines) + "\n")
    return index([out], out / "idx", tokenizer=engine_dir)


@pytest.mark.parametrize("k_policy", ["fixed", "load-aware"])
def test_drafts_come_from_the_index_and_output_equals_the_target_alone(plain, reference, answers_index, k_policy):
    without = Generator(plain, drafter="suffix", num_draft_tokens=4, k_policy=k_policy)
    with_index = Generator(plain, datastore=answers_index, num_draft_tokens=4, k_policy=k_policy)
    assert with_index.scheduler.drafter_name == "suffix"  # a datastore makes suffix decoding the default
    first = [with_index.generate(p, max_new_tokens=40) for p in PROMPTS]
    assert [r.token_ids for r in first] == reference
    alone = [without.generate(p, max_new_tokens=40) for p in PROMPTS]
    assert [r.token_ids for r in alone] == reference
    if k_policy == "fixed":  # the index held these answers: far more tokens a call than the prompts alone give
        calls = lambda rs: sum(r.stats.new_tokens for r in rs) / sum(r.stats.target_calls for r in rs)  # noqa: E731
        assert calls(first) > 1.5 * calls(alone)
    text = "".join(with_index.stream(PROMPTS[1], max_new_tokens=40))
    assert text == with_index.tokenizer.decode(reference[1], skip_special_tokens=True)
    without.close()
    with_index.close()


def test_seeded_sampling_over_the_index_is_the_target_alone_sample(plain, answers_index):
    params = dict(max_new_tokens=30, temperature=0.9, top_p=0.95)
    alone = Generator(plain)
    over = Generator(plain, datastore=answers_index, num_draft_tokens=4, k_policy="fixed")
    for seed in range(4):
        for p in PROMPTS:
            assert over.generate(p, seed=seed, **params).token_ids == alone.generate(p, seed=seed, **params).token_ids
    assert over.scheduler.stats().proposed > 0
    alone.close()
    over.close()


def test_concurrent_requests_share_one_mapped_index_and_equal_their_output_alone(plain, reference, answers_index):
    sched = Scheduler(plain, datastore=answers_index, num_draft_tokens=4)
    assert sched.drafter.datastore is sched.datastore  # one mapping for every row and request
    prompts = PROMPTS * 3
    results: dict[int, list[int]] = {}

    def ask(i):
        results[i] = sched.submit(prompts[i], max_new_tokens=40).result().token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(len(prompts))] == reference * 3
    assert sched.stats().proposed > 0
    sched.close()


def test_a_datastore_goes_with_suffix_decoding_only(plain, answers_index):
    with pytest.raises(ValueError, match="datastore extends suffix decoding"):
        Generator(plain, drafter="prompt_lookup", datastore=answers_index)


def test_the_index_command_writes_what_generate_reads(tmp_path, engine_dir, capsys):
    from trtspec.cli import main

    (tmp_path / "notes.md").write_text("The quick brown fox jumps over the lazy dog.\n" * 3)
    assert main(["index", str(tmp_path / "notes.md"), "-o", str(tmp_path / "idx"), "--tokenizer",
                 str(engine_dir)]) == 0
    assert Datastore(tmp_path / "idx").tokens > 0
    assert main(["generate", "--target", str(engine_dir), "--datastore", str(tmp_path / "idx"), "--prompt",
                 "The quick brown", "--max-new-tokens", "8", "--no-stream"]) == 0
    assert main(["index", str(tmp_path / "nowhere"), "-o", str(tmp_path / "idx2"), "--tokenizer",
                 str(engine_dir)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sampling_over_the_index_follows_the_target_distribution(exported, model_dir, tmp_path):
    """The chi-square law test the other drafters pass: the index's drafts, with both outcomes, under coupled
    sampling leave the distribution of sampled sequences the target's own."""
    import json

    from test_verify import ALPHA, _chi_square_p_value, _exact_joint, _sample_sequences

    from trtspec.runtime import SamplingParams

    engine_dir = exported(ARCH, max_seq_len=16, max_batch=64)
    target = load_engine(engine_dir)
    params = SamplingParams(temperature=1.5, top_k=4)
    sampler = Generator(target)
    prompt = sampler.tokenizer("def")["input_ids"]
    # the index: 64 of the target's own samples, so its drafts are often, not always, what the target samples next
    lines = [json.dumps({"token_ids": prompt + sampler.generate("def", max_new_tokens=3, temperature=1.5, top_k=4,
                                                                 seed=s).token_ids}) for s in range(64)]
    sampler.close()
    (tmp_path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    idx = index([tmp_path / "samples.jsonl"], tmp_path / "idx", tokenizer=engine_dir)
    gen = Generator(target, datastore=idx, num_draft_tokens=2, k_policy="fixed")
    joint = _exact_joint(model_dir(ARCH), prompt, params, depth=3)
    counts, _ = _sample_sequences(gen, "def", params, 20_480, seed=1)
    assert sum(counts.values()) == 20_480
    assert _chi_square_p_value(counts, joint) > ALPHA
    stats = gen.scheduler.stats()
    assert stats.proposed > 0 and 0.02 < stats.accepted / stats.proposed < 0.98
    gen.close()
