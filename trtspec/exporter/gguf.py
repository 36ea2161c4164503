"""GGUF in: llama.cpp's file as an export source, with its quantized blocks kept for the build.

transformers reads a GGUF (config, tokenizer, chat template, EOS ids) and dequantizes its tensors to floats: the
export's step graph is that float model, as for any HF directory. Beside it the export keeps, for every linear
layer stored in a type we can run as it is, the file's own codes in the layout of onnxruntime's ``MatMulNBits``
(``blocks.npz``), so `build` gives an engine whose weights *are* the file's, not a second rounding of them:

    Q4_0  d * (q - 8)          4-bit codes, zero point 8, scale d         (MatMulNBits' own form)
    Q4_1  d * q + m            4-bit codes, zero point 0, scale d, and m per block (see the build's ``gguf_linears``)
    Q4_K  d*sc * q - dmin*mn   4-bit codes per 32, scale d*sc, minimum -dmin*mn (the 256-block's 6-bit sc/mn)
    Q8_0  d * q                8-bit codes q + 128, zero point 128, scale d
    Q5_0, Q5_1, Q5_K           8-bit codes q + 128 - z, zero point 128 (Q5_1, Q5_K: and their minimums)
    Q6_K  d*sc * (q - 32)      8-bit codes q + 96, zero point 128, scale d*sc per block of 16

(kernels/blocks.py decodes every type), per block of 32 weights along the input axis but Q6_K's 16. The 5- and
6-bit types have no 5- or 6-bit MatMulNBits; their codes are kept exactly at 8 bits, never rounded again. The
minimum of Q4_1/Q4_K has no place in MatMulNBits' integer zero point; its float zero point takes it, but
onnxruntime 1.32 runs that form 35x slower (dequantize, then a float GEMM: 757 vs 21 us for a 1536x576 layer,
bench_gguf_kernels.py), so the build adds the minimum's term as ``blocksum(x) @ M^T`` instead, the exact rewrite of
sum_i x_i (d q_i + m) that llama.cpp's own Q4_1 dot product uses. Each kept tensor is checked at export: its codes,
scales and minimums, put together as the engine reads them, equal the float weights transformers dequantized, bit
for bit, after llama.cpp's permutation of the query/key rows is undone (found by trying it, not assumed). Other
types (IQ*, Q2_K, Q3_K) are not kept: the build quantizes their float weights to 4 bits itself and records the error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path

import numpy as np

from ..errors import UnsupportedModelError
from ..kernels import blocks
from ..int4_packing import pack_codes

log = logging.getLogger("trtspec.export")

BLOCKS_FILE = "blocks.npz"
KEPT_TYPES = blocks.TYPES


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one .gguf in a directory without config.json."""
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        with open(path, "rb") as f:
            return path if f.read(4) == b"GGUF" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise UnsupportedModelError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                                    "pass the one to export")
    return files[0] if files else None


def hf_source(path) -> tuple[Path, dict]:
    """(folder, keyword arguments) for transformers' from_pretrained: an HF directory as it is, or a GGUF file
    (or a directory holding one) as its folder and ``gguf_file``."""
    path = Path(path)
    found = find_gguf(path)
    return (path, {}) if found is None else (found.parent, {"gguf_file": found.name})


def _reader(path: Path):
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UnsupportedModelError("reading a GGUF file needs the gguf and accelerate packages: "
                                    "pip install 'trtspec[gguf]'") from None
    try:
        return _parsed(path)
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError on a foreign or cut file
        raise UnsupportedModelError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


_PARSED: dict = {}  # (path, mtime, size) -> its GGUFReader: the last file read
_GGUF: dict = {}  # gguf's and transformers' functions, while _one_parse() stands in for them
_METADATA: dict = {}  # (reader, file) -> transformers' metadata of it (load_gguf_checkpoint without tensors)


def _reader_class():
    """gguf.GGUFReader with a faster ``_get``: the stock one slices the file's np.memmap (whose every view costs
    microseconds in its __array_finalize__) once for each of a vocabulary's 100k strings and their lengths. This
    one slices a plain ndarray view of the same mapped bytes: the same fields and tensors (tests/test_gguf.py
    compares them), 3x faster to parse SmolLM2's metadata (2.2 -> 0.7 s)."""
    import gguf

    class Reader(_GGUF.get("GGUFReader", gguf.GGUFReader)):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


def _parsed(path):
    """One GGUFReader per file (and version of it): parsing the metadata of a 49k-token vocabulary takes seconds, and
    one load asks for it six times (transformers' config, tokenizer and model, our description and tensors)."""
    import gguf

    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    if key not in _PARSED:
        _PARSED.clear()
        try:
            _PARSED[key] = _reader_class()(path)
        except (AttributeError, TypeError):  # (another gguf's internals: its own reader, slower)
            _PARSED[key] = _GGUF.get("GGUFReader", gguf.GGUFReader)(path)
    return _PARSED[key]


def _metadata_once(path, return_tensors=False, **kwargs):
    """transformers' load_gguf_checkpoint, its metadata-only result kept for the file's reader: the config, the
    tokenizer's config and the model each ask for it (half a second each for SmolLM2's 49k-token vocabulary)."""
    import copy

    load = _GGUF["load_gguf_checkpoint"]
    if return_tensors or kwargs:
        return load(path, return_tensors=return_tensors, **kwargs)
    key = id(_parsed(path)), str(path)
    if key not in _METADATA:
        _METADATA.clear()
        _METADATA[key] = load(path, return_tensors=False)
    return copy.deepcopy(_METADATA[key])


@contextlib.contextmanager
def _one_parse():
    """Inside, gguf.GGUFReader is _parsed, gguf.get_tensor_name_map remembers its maps, and transformers'
    metadata-only load_gguf_checkpoint is read once: transformers' GGUF loading constructs a reader for each of the
    config, the tokenizer and the weights, and a name map for every module."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    if _GGUF:  # (already inside)
        yield
        return
    _GGUF.update(GGUFReader=gguf.GGUFReader, get_tensor_name_map=gguf.get_tensor_name_map,
                 load_gguf_checkpoint=hf_gguf.load_gguf_checkpoint)
    gguf.GGUFReader = _parsed
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(_GGUF["get_tensor_name_map"])
    hf_gguf.load_gguf_checkpoint = _metadata_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = _GGUF.pop("GGUFReader"), _GGUF.pop("get_tensor_name_map")
        hf_gguf.load_gguf_checkpoint = _GGUF.pop("load_gguf_checkpoint")
        _METADATA.clear()


def describe(path: Path) -> dict:
    """The file's architecture and what its tensors are stored as, e.g. {"Q4_1": 210, "F32": 61, "Q8_0": 1}."""
    reader = _reader(path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    arch = reader.fields.get("general.architecture")
    return {"architecture": arch.contents() if arch is not None else None, "tensor_types": types}


def load(path: Path, dtype: str):
    """(config, tokenizer, generation_config, float model) from a GGUF file, through transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import accelerate  # noqa: F401  transformers' GGUF loader needs it
    except ImportError:
        raise UnsupportedModelError("reading a GGUF file needs the gguf and accelerate packages: "
                                    "pip install 'trtspec[gguf]'") from None
    with _one_parse():
        return _load(path, dtype)


def _load(path: Path, dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    info = describe(path)
    folder, name = path.parent, path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except ValueError as e:  # transformers: "GGUF model with architecture X is not supported yet."
        raise UnsupportedModelError(f"{path}: architecture {info['architecture']!r} cannot be read from GGUF by "
                                    f"transformers ({e})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedModelError(f"{path}: its tokenizer cannot be read ({type(e).__name__}: {e})") from None
    log.info("dequantizing %s (%s)", path, ", ".join(f"{k} x{v}" for k, v in sorted(info["tensor_types"].items())))
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    except (ValueError, NotImplementedError, KeyError) as e:
        raise UnsupportedModelError(f"{path}: transformers cannot load its weights ({type(e).__name__}: {e}); "
                                    f"tensor types {info['tensor_types']}") from None
    model.eval()
    return config, tokenizer, None, model


# ---- the file's codes in MatMulNBits' layout -------------------------------------------------------------------

def unpack(type_name: str, raw: np.ndarray, n: int, k: int) -> dict:
    """One tensor's blocks (``raw``: its bytes, [n, bytes per row]) -> MatMulNBits' form (``matmulnbits_form``)."""
    if type_name not in KEPT_TYPES:
        raise ValueError(f"GGUF type {type_name} is not kept as it is; choose one of {', '.join(KEPT_TYPES)}")
    return matmulnbits_form(blocks.decode(type_name, raw, n, k))


def matmulnbits_form(b: blocks.Blocks) -> dict:
    """Blocks -> codes [n, k] (uint8), scales [n, k/block] (float32), zero_point (int), minimums [n, k/block]
    (float32, or None), bits and block: weight = scale * (code - zero_point) + minimum. 4-bit types keep their codes;
    the others become 8-bit codes with zero point 128, exactly (code + 128 - the type's own zero point)."""
    codes, zero = b.codes, b.zero
    if b.bits > 4:
        codes, zero = (b.codes.astype(np.int16) + (128 - b.zero)).astype(np.uint8), 128
    return {"codes": codes, "scales": b.scales, "zero_point": zero, "minimums": b.minimums,
            "bits": 4 if b.bits == 4 else 8, "block": b.group}


def weights_of(unpacked: dict) -> np.ndarray:
    """The float weights [n, k] the engine computes with: scale * (code - zero_point) [+ minimum], the arithmetic
    of gguf's own dequantize()."""
    n, k = unpacked["codes"].shape
    block = unpacked["block"]
    codes = unpacked["codes"].reshape(n, k // block, block).astype(np.float32) - np.float32(unpacked["zero_point"])
    w = unpacked["scales"][..., None] * codes
    if unpacked["minimums"] is not None:
        w = w + unpacked["minimums"][..., None]
    return w.reshape(n, k)


def pack(unpacked: dict) -> np.ndarray:
    """MatMulNBits' B [n, k/block, block * bits / 8] of a tensor's codes (int4_packing.py)."""
    return pack_codes(unpacked["codes"], unpacked["bits"], unpacked["block"])


def _row_orders(n: int, num_heads: int, num_kv_heads: int) -> list[tuple[str, np.ndarray | None]]:
    """Row orders a GGUF tensor may need: as stored, or with llama.cpp's rotary permutation of q/k undone."""
    orders: list[tuple[str, np.ndarray | None]] = [("as stored", None)]
    for heads in dict.fromkeys((num_heads, num_kv_heads)):
        if heads and n % (2 * heads) == 0:
            half = n // heads // 2
            rows = np.arange(n).reshape(heads, half, 2).swapaxes(2, 1).reshape(n)
            orders.append((f"rotary rows of {heads} heads restored", rows))
    return orders


def tensors_by_hf_name(path: Path, hf) -> dict:
    """{the HF parameter name a tensor of the file loads into: the file's tensor}."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    with _one_parse():
        to_hf = get_gguf_hf_weights_map(hf, TensorProcessor())
    return {to_hf.get(t.name): t for t in _reader(path).tensors}


def file_blocks(t, w: np.ndarray, num_heads: int, num_kv_heads: int) -> tuple[blocks.Blocks, str] | str:
    """A file tensor's Blocks in the row order of ``w`` (the float weight [out, in] transformers loaded from it) and
    which order that is, or why it cannot be kept: a type not kept, a ragged input, or blocks that dequantize to
    other weights in every known row order."""
    type_name = t.tensor_type.name
    n, k = w.shape
    if type_name not in KEPT_TYPES:
        return f"{type_name}: not a type kept as it is"
    if k % blocks.FORMATS[type_name][2]:
        return f"{type_name}: input size {k} is not a whole number of blocks"
    b = blocks.decode(type_name, t.data, n, k)
    deq = blocks.dequantize(b)
    for how, rows in _row_orders(n, num_heads, num_kv_heads):
        if np.array_equal(deq if rows is None else deq[rows], w):
            return (b if rows is None else b.take_rows(rows)), how
    return f"{type_name}: its dequantized blocks differ from the weights transformers loaded (in every known row order)"


def keep_blocks(path: Path, hf, linears: dict[str, np.ndarray], num_heads: int, num_kv_heads: int,
                progress=None) -> tuple[dict[str, np.ndarray], dict]:
    """The file's blocks for the graph's linear layers.

    ``linears``: {graph node name: its float weight [out, in] as the graph holds it}. Returns (arrays for
    BLOCKS_FILE, the manifest's description): kept layers by type, and the others with why."""
    tensors = tensors_by_hf_name(path, hf)
    tied = getattr(hf.config, "tie_word_embeddings", False)
    embed = hf.get_input_embeddings().weight
    arrays: dict[str, np.ndarray] = {}
    kept: dict[str, dict] = {}
    others: dict[str, str] = {}
    names = {n for n, _ in hf.named_parameters(remove_duplicate=False)}
    for i, (node, w) in enumerate(linears.items()):
        if progress is not None:
            progress.update(i, node)
        hf_name = next((p for p in names if p == f"{node}.weight" or p.endswith(f".{node}.weight")), None)
        if hf_name not in tensors and node == "lm_head" and tied:
            hf_name = next(p for p, v in hf.named_parameters() if v is embed)
        t = tensors.get(hf_name)
        if t is None:
            others[node] = "no tensor of the file found for it"
            continue
        found = file_blocks(t, w, num_heads, num_kv_heads)
        if isinstance(found, str):
            others[node] = found
            continue
        b, how = found
        unpacked = matmulnbits_form(b)
        arrays[f"{node}/B"] = pack(unpacked)
        arrays[f"{node}/scales"] = np.ascontiguousarray(unpacked["scales"])
        if unpacked["minimums"] is not None:
            arrays[f"{node}/minimums"] = np.ascontiguousarray(unpacked["minimums"])
        kept[node] = {"type": b.type_name, "tensor": t.name, "bits": unpacked["bits"], "block": unpacked["block"],
                      "zero_point": unpacked["zero_point"], "minimums": unpacked["minimums"] is not None,
                      "rows": how}
    if progress is not None:
        progress.update(len(linears))
    return arrays, {"kept": kept, "not_kept": others}
