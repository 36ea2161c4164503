"""A datastore for suffix decoding: a corpus the user indexes (code, documents, past answers), drafted from when the
request's own text and earlier outputs have nothing as long (retrieval drafting, REST: He et al. 2024).

``build_index(paths, out, tokenizer=...)`` tokenizes the files with the engine's tokenizer and writes a directory:

    manifest.json   format "trtspec-datastore": tokens, token width, the separator id, the tokenizer's fingerprint
                    (vocabulary size and a sha256 of its token -> id map), each source file's path, size, mtime and tokens (``sources``)
    text.bin        the corpus' token ids in REVERSE order, each a big-endian unsigned integer of ``width`` bytes
                    (2 for a vocabulary below 0xFF00 ids, else 4); SEP (the width's largest value) after every document
    sa.bin          the suffix array of text.bin: uint32 little-endian starts of its suffixes, sorted by their first
                    DEPTH tokens (prefix doubling; ties beyond DEPTH keep position order)

Both files are memory-mapped at load: nothing is read until a lookup touches it, and every process that maps one
index shares its pages (a served process shares one Datastore between its requests). 6 bytes a token (2-byte ids)
or 8 (4-byte ids).

Why reversed and big-endian: the row's last tokens read backwards are a *prefix* of the suffixes that continue
where they occur, so one binary search over the suffix array finds the longest match of the row's tail (the
longest common prefix with the insertion point's neighbours), and big-endian ids make byte order token order, so
each comparison is one bytes comparison of the mapped file. A match at reversed position q ends at forward
position N - 1 - q; what followed it is text.bin[q - 1], text.bin[q - 2], ...

A lookup returns up to MAX_OCCURRENCES continuations, spread evenly over the matching range of the suffix array:
that range is sorted by what follows the match, so an even spread samples the continuations in proportion to their
frequency, and the suffix drafter's trie turns those shares into scores.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from hashlib import sha256
from pathlib import Path

import numpy as np

from ...errors import ArtifactError
from ...kernels import release_openmp_workers
from ...kernels import text as text_kernels
from ...manifest import atomic_artifact
from ...progress import Progress
from .suffix_text import MAX_OCCURRENCES, MIN_MATCH

FORMAT = "trtspec-datastore"
DEPTH = 16  # suffixes are sorted by their first DEPTH tokens: the longest match a lookup can find
TEXT, SA = "text.bin", "sa.bin"
DEFAULT_PATTERNS = ("*.py", "*.md", "*.rst", "*.txt", "*.json", "*.jsonl", "*.c", "*.h", "*.cpp", "*.js", "*.ts",
                    "*.java", "*.go", "*.rs", "*.toml", "*.yaml", "*.yml", "*.html", "*.css", "*.sh")
_JSONL_KEYS = ("text", "prompt", "completion", "response", "output", "answer", "content")

log = logging.getLogger("trtspec.datastore")


def tokenizer_fingerprint(tokenizer) -> dict:
    """What makes two tokenizers interchangeable for the index: the same token -> id map."""
    vocab = tokenizer.get_vocab()
    digest = sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()).hexdigest()
    return {"vocab_size": len(vocab), "vocab_sha256": digest}


# -- building ---------------------------------------------------------------------------------------------------


def _documents(path: Path, limit: int) -> list[str | list[int]]:
    """A file's documents: a .jsonl file's records (a string; an object's text fields, or its messages' contents;
    or an object's ``token_ids``, taken as they are: answers logged as the engine's ids), else the whole file. A file
    that is not UTF-8 text gives none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    if path.suffix != ".jsonl":
        return [text] if text.strip() else []
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path}:{n} is not a JSON line ({e.msg}); a .jsonl corpus holds one JSON string or "
                                "object a line") from None
        if isinstance(record, str):
            docs.append(record)
        elif isinstance(record, dict) and "token_ids" in record:
            ids = record["token_ids"]
            if not (isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < limit for t in ids)):
                raise ArtifactError(f"{path}:{n}: token_ids must be a list of non-negative token ids below {limit}")
            docs.append(ids)
        elif isinstance(record, dict):
            parts = [record[k] for k in _JSONL_KEYS if isinstance(record.get(k), str)]
            parts += [m["content"] for m in record.get("messages", []) if isinstance(m, dict)
                      and isinstance(m.get("content"), str)]
            if parts:
                docs.append("\n".join(parts))
    return docs


def _files(paths, patterns) -> list[Path]:
    found: dict[Path, None] = {}
    for p in (Path(p).expanduser() for p in paths):
        if p.is_file():
            found[p.resolve()] = None
        elif p.is_dir():
            for pattern in patterns:
                for f in sorted(p.rglob(pattern)):
                    if f.is_file():
                        found[f.resolve()] = None
        else:
            raise ArtifactError(f"{p} does not exist; give files or directories to index")
    return sorted(found)


def suffix_array(text: np.ndarray, depth: int = DEPTH, *, native: bool = True) -> np.ndarray:
    """The starts of ``text``'s suffixes (ids [N] below 2**32) sorted by their first ``depth`` tokens, by prefix
    doubling: sort by a few tokens packed in one integer, then by (rank of the first k tokens, rank of the k after
    them) until k reaches depth. Ties beyond ``depth`` stay in position order (stable sorts). ``native``: the
    compiled kernels' sort where they load (kernels/text.py), else this numpy one."""
    n = text.size
    if n == 0:
        return np.zeros(0, np.uint32)
    # each id as its rank among the ids present, from 1 (order kept; 0: past the end, below every token, so a prefix
    # sorts first): a 49,152-token vocabulary and its separator pack 4 to a key in 16 bits, not 3 in 17
    values = np.cumsum(np.bincount(text) > 0).astype(np.uint64)[text]
    bits = int(values.max()).bit_length()
    if native:
        order = text_kernels.suffix_array(values, bits, depth)  # the same order, several times faster
        if order is not None:
            return order
    k = max(1, min(depth, 64 // bits))  # tokens packed side by side in one uint64 key
    padded = np.concatenate([values, np.zeros(k, np.uint64)])
    key = np.zeros(n, np.uint64)
    for j in range(k):
        key = (key << np.uint64(bits)) | padded[j : j + n]
    order = np.argsort(key, kind="stable")
    while True:
        sorted_key = key[order]
        rank = np.empty(n, np.int64)
        rank[order] = np.concatenate([[0], np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        if k >= depth or rank[order[-1]] == n - 1:
            return order.astype(np.uint32)
        # (rank of the first k tokens + 1, rank of the next k + 1; 0 past the end): the first 2k tokens' order
        after = np.zeros(n, np.int64)
        after[: n - k] = rank[k:] + 1
        key = ((rank + 1) * (n + 1) + after).astype(np.uint64)
        order = order[np.argsort(key[order], kind="stable")]
        k *= 2


def build_index(paths, out_dir, *, tokenizer, patterns=DEFAULT_PATTERNS) -> Path:
    """Index the files under ``paths`` (files, or directories searched for ``patterns``) with ``tokenizer`` (an
    engine or export directory, or a loaded HF tokenizer) into ``out_dir``; returns it. An index already at
    ``out_dir`` built with the same tokenizer lends the tokens of every file whose size and mtime are unchanged,
    so a rebuild tokenizes only what changed. ``trtspec index`` is this call."""
    tok = _load_tokenizer(tokenizer)
    fingerprint = tokenizer_fingerprint(tok)
    native = text_kernels.byte_level_bpe(tok)  # the same ids, several times faster (None: the tokenizer's own)
    files = _files(paths, patterns)
    if not files:
        raise ArtifactError(f"no files matching {', '.join(patterns)} under {', '.join(map(str, paths))}")
    vocab_size = fingerprint["vocab_size"]
    width = 2 if vocab_size < 0xFF00 else 4  # (a margin: a model's rows may pad its vocabulary past the tokenizer's)
    sep = (1 << (8 * width)) - 1
    old = _reusable(Path(out_dir), fingerprint)
    t0 = time.perf_counter()
    total = sum(f.stat().st_size for f in files)
    progress = Progress("indexing", total, "bytes", log)
    chunks: list[np.ndarray] = []
    entries, done, reused, text_bytes = [], 0, 0, 0
    batch: list[tuple[Path, os.stat_result, list[str]]] = []

    def flush():  # one tokenizer call over a batch of files' documents (the fast tokenizer runs them in parallel)
        texts = [d for _, _, file_docs in batch for d in file_docs if isinstance(d, str)]
        encoded = iter((native.encode(texts) if native else _encode(tok, texts)) if texts else [])
        for f, st, file_docs in batch:
            parts = []
            for d in file_docs:
                parts += [np.asarray(next(encoded) if isinstance(d, str) else d, np.int64), np.array([sep], np.int64)]
            add(f, st, np.concatenate(parts) if parts else np.zeros(0, np.int64))
        batch.clear()

    def add(f, st, ids):
        if ids.size:
            chunks.append(ids)
            entries.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "tokens": int(ids.size)})

    pending = 0
    for f in files:
        st = f.stat()
        ids = old.get((str(f), st.st_size, st.st_mtime_ns)) if old else None
        if ids is not None:
            reused += 1
            flush()  # (files keep their order: a reused file's tokens go after those tokenized before it)
            add(f, st, ids)
        else:
            batch.append((f, st, _documents(f, sep)))
            pending += st.st_size
            if pending >= 1 << 21:
                flush()
                pending = 0
        text_bytes += st.st_size
        done += st.st_size
        progress.update(done, f.name)
    flush()
    progress.close()
    forward = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    if forward.size >= 1 << 32:
        raise ArtifactError(f"{forward.size} tokens: an index holds at most 2**32 - 1; index less text")
    reverse = forward[::-1].copy()
    t1 = time.perf_counter()
    log.info("sorting %d tokens' suffixes", reverse.size)
    sa = suffix_array(reverse)
    # the native tokenizer's and sort's OpenMP pool on this thread: kept, it would slow the engines' calls 5x
    release_openmp_workers()
    manifest = {"format": FORMAT, "tokens": int(reverse.size), "width": width, "sep": sep, "depth": DEPTH,
                "tokenizer": fingerprint, "sources": entries,
                "build": {"seconds": None, "tokenize_seconds": round(t1 - t0, 3), "text_bytes": text_bytes,
                          "files_reused": reused}}
    with atomic_artifact(out_dir, manifest) as tmp:
        reverse.astype(">u2" if width == 2 else ">u4").tofile(tmp / TEXT)
        sa.astype("<u4").tofile(tmp / SA)
        manifest["build"]["seconds"] = round(time.perf_counter() - t0, 3)
    log.info("indexed %d files, %d tokens (%.1f MB of text) in %.1f s", len(entries), reverse.size, text_bytes / 1e6,
             time.perf_counter() - t0)
    return Path(out_dir)


def _encode(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens: a fast tokenizer's backend without offsets where it has one
    (1.3x faster here: the offsets are most of what the ids do not need), else the tokenizer's own call."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def _load_tokenizer(tokenizer):
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    path = Path(tokenizer)
    manifest = path / "manifest.json"
    if manifest.is_file():  # an engine or export artifact: its tokenizer directory
        path = path / json.loads(manifest.read_text()).get("tokenizer", "tokenizer")
    if not path.is_dir():
        raise ArtifactError(f"{tokenizer} is neither an engine or export directory nor a tokenizer directory")
    return AutoTokenizer.from_pretrained(path)


def _reusable(out: Path, fingerprint: dict) -> dict:
    """(path, size, mtime) -> forward token ids of each file an existing index at ``out`` holds, if it was built
    with the same tokenizer and is whole; else {}."""
    try:
        store = Datastore(out)
    except ArtifactError:
        return {}
    if store.manifest["tokenizer"] != fingerprint:
        return {}
    forward = np.frombuffer(store._text, dtype=store._dtype)[::-1]
    found, at = {}, 0
    for e in store.manifest["sources"]:
        found[(e["path"], e["size"], e["mtime_ns"])] = forward[at : at + e["tokens"]].astype(np.int64)
        at += e["tokens"]
    return found


# -- lookups ------------------------------------------------------------------------------------------------------


class Datastore:
    """An index built by ``build_index``, memory-mapped. ``find(tail, depth)`` -> (match length, continuations);
    ``check_tokenizer(tokenizer)`` refuses an index of another vocabulary. Safe to share between threads (lookups
    only read)."""

    def __init__(self, path):
        self.path = Path(path)
        manifest_file = self.path / "manifest.json"
        try:
            manifest = json.loads(manifest_file.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"{self.path} is not a datastore index (no manifest.json); build one with "
                                "`trtspec index PATHS -o DIR --tokenizer ENGINE`") from None
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{manifest_file} is corrupt ({e.msg}); rebuild the index") from None
        if manifest.get("format") != FORMAT:
            raise ArtifactError(f"{self.path} is a {manifest.get('format')!r} artifact, not a datastore index; build "
                                "one with `trtspec index`")
        self.manifest = manifest
        self.tokens, self.width, self.sep = manifest["tokens"], manifest["width"], manifest["sep"]
        self.depth = manifest.get("depth", DEPTH)
        self._dtype = ">u2" if self.width == 2 else ">u4"
        self._text = self._map(TEXT, self.tokens * self.width)
        self._sa_map = self._map(SA, self.tokens * 4)
        self._sa = memoryview(self._sa_map).cast("I") if self.tokens else memoryview(b"").cast("I")
        # a few entries checked: a shuffled or foreign sa.bin of the right size is caught here, not by a wrong draft
        if self.tokens:
            probe = np.frombuffer(self._sa_map, dtype="<u4")[:: max(1, self.tokens // 64)]
            if int(probe.max()) >= self.tokens:
                raise ArtifactError(f"{self.path / SA} is corrupt (a suffix starts past the text); rebuild the index")

    def _map(self, name: str, size: int):
        path = self.path / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise ArtifactError(f"{path} is missing: the index is incomplete; rebuild it with `trtspec index`") from None
        if actual != size:
            raise ArtifactError(f"{path} holds {actual} bytes where the manifest says {size}: the index is truncated "
                                "or was not written whole; rebuild it with `trtspec index`")
        if size == 0:
            return b""
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return self.tokens

    def check_tokenizer(self, tokenizer, what: str = "the target") -> None:
        """Refuse an index built with another tokenizer (its ids would mean other text)."""
        mine, theirs = self.manifest["tokenizer"], tokenizer_fingerprint(tokenizer)
        if mine != theirs:
            raise ArtifactError(
                f"the datastore {self.path} was built with another tokenizer ({mine['vocab_size']} tokens) than "
                f"{what}'s ({theirs['vocab_size']} tokens, or the same size with other ids); rebuild it with "
                f"`trtspec index ... --tokenizer` naming {what}'s engine")

    def _key(self, ids) -> bytes:
        return np.asarray(ids, dtype=self._dtype).tobytes()

    def _suffix(self, i: int, length: int) -> bytes:
        q = self._sa[i] * self.width
        return self._text[q : q + length]

    def _bound(self, key: bytes, upper: bool) -> int:
        # the first suffix-array index whose first len(key) bytes are >= key (upper: > key)
        lo, hi, n = 0, self.tokens, len(key)
        sa, text, w = self._sa, self._text, self.width
        while lo < hi:
            mid = (lo + hi) >> 1
            q = sa[mid] * w
            s = text[q : q + n]
            if s < key or (upper and s == key):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, tail, depth: int, *, max_match: int | None = None) -> tuple[int, list[tuple[int, ...]]]:
        """(the longest match, up to MAX_OCCURRENCES continuations of up to ``depth`` tokens) of a suffix of
        ``tail`` (the row's last tokens; at most ``max_match``, default the index's sort depth, are read), at least
        MIN_MATCH tokens long; (0, []) if none."""
        longest = min(max_match or self.depth, self.depth, len(tail))
        if not self.tokens or longest < MIN_MATCH or depth < 1:
            return 0, []
        tail = list(tail[-longest:])
        if max(tail) >= self.sep:  # an id the index cannot hold: only what follows it can match
            tail = tail[len(tail) - next(i for i, t in enumerate(reversed(tail)) if t >= self.sep) :]
            if len(tail) < MIN_MATCH:
                return 0, []
        key = self._key(tail[::-1])
        w = self.width
        i = self._bound(key, upper=False)
        m = 0  # the longest common prefix (tokens) of key and the suffixes beside its insertion point
        for j in (i - 1, i):
            if 0 <= j < self.tokens:
                s = self._suffix(j, len(key))
                c = 0
                while c < len(s) and s[c] == key[c]:
                    c += 1
                m = max(m, c // w)
        if m < MIN_MATCH:
            return 0, []
        prefix = key[: m * w]
        lo, hi = self._bound(prefix, upper=False), self._bound(prefix, upper=True)
        count = hi - lo
        picks = range(lo, hi) if count <= MAX_OCCURRENCES else (lo + (2 * t + 1) * count // (2 * MAX_OCCURRENCES)
                                                                 for t in range(MAX_OCCURRENCES))
        found = []
        for idx in picks:
            q = self._sa[idx]  # the match ends at reversed q; what followed it: reversed q - 1, q - 2, ...
            start = max(0, q - depth)
            cont = np.frombuffer(self._text[start * w : q * w], dtype=self._dtype)[::-1].tolist()
            if self.sep in cont:
                cont = cont[: cont.index(self.sep)]
            if cont:
                found.append(tuple(cont))
        return (m, found) if found else (0, [])

    def occurrences(self, tail) -> int:
        """How often ``tail`` (a token sequence of at most the sort depth) occurs in the corpus."""
        key = self._key(list(tail)[::-1])
        return self._bound(key, upper=True) - self._bound(key, upper=False)


def open_datastore(datastore) -> Datastore | None:
    """None, a loaded Datastore, or a path to load."""
    if datastore is None or isinstance(datastore, Datastore):
        return datastore
    return Datastore(datastore)


__all__ = ["DEPTH", "Datastore", "build_index", "open_datastore", "suffix_array", "tokenizer_fingerprint"]
