"""What the torch backend compiles: an HF model directory or a GGUF file, or the one an export/ artifact was made from.

The engine's manifest mirrors an export manifest's "model" section (same helpers,
same fingerprint), so the runtime checks a torch engine against an onnxruntime
or TensorRT one exactly as it checks two exported ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ArtifactError
from ..exporter.gguf import find_gguf
from ..exporter.step_graph import TORCH_DTYPES, describe_tree_and_features, load_for_step, model_description
from ..manifest import EXPORT_FORMAT, MANIFEST, read_manifest, sha256_file

DEFAULT_MAX_SEQ_LEN = 512
DEFAULT_MAX_BATCH = 4
DEFAULT_DTYPE = "float32"


@dataclass
class Source:
    hf_model: object  # the transformers model, eval mode
    spec: object  # ArchSpec
    path: Path  # engine.path: the directory the tokenizer path is relative to
    manifest: dict
    gguf_file: Path | None = None  # the GGUF file the model was read from, if it was
    tokenizer: object = None  # the transformers tokenizer


def load_source(path: Path, *, max_seq_len: int | None, max_batch: int | None, dtype: str | None,
                tree: bool | None = None, hidden_states=None) -> Source:
    """Load the HF model behind an HF model dir, a GGUF file or an export/ dir, and describe it like an export
    manifest.

    ``tree`` / ``hidden_states`` as for export(); None: the export's own (an HF dir: no tree, no features)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return _from_export(path, max_seq_len, max_batch, dtype, tree, hidden_states)
    if not (path / "config.json").is_file() and find_gguf(path) is None:
        raise ArtifactError(
            f"{path} is neither a Hugging Face model directory (no config.json), a GGUF file nor a trtspec export "
            f"(no {MANIFEST}); pass one of them"
        )
    return _load(path, path, ".", _or(max_seq_len, DEFAULT_MAX_SEQ_LEN), _or(max_batch, DEFAULT_MAX_BATCH),
                 _or(dtype, DEFAULT_DTYPE), ring_cache=not tree, tree=bool(tree), hidden_states=hidden_states)


def _or(value, default):
    return default if value is None else value


def _from_export(path: Path, max_seq_len, max_batch, dtype, tree, hidden_states) -> Source:
    exported = read_manifest(path)
    if exported["format"] != EXPORT_FORMAT:
        raise ArtifactError(
            f"{path} is a built engine ({exported.get('backend')}), not an export; "
            "pass its export/ directory or the HF model directory"
        )
    model_dir = Path(exported["source"]["model_dir"])
    if "gguf_sha256" in exported["source"]:  # exported from a GGUF file
        if not model_dir.is_file():
            raise ArtifactError(f"{path} was exported from {model_dir}, which is gone; pass the GGUF file itself")
        if sha256_file(model_dir) != exported["source"]["gguf_sha256"]:
            raise ArtifactError(f"{model_dir} changed since {path} was exported; re-export, or pass the file itself")
    elif not (model_dir / "config.json").is_file():
        raise ArtifactError(
            f"{path} was exported from {model_dir}, which is gone; the torch backend compiles the HF weights, "
            "so pass the HF model directory itself"
        )
    elif sha256_file(model_dir / "config.json") != exported["source"]["config_sha256"]:
        raise ArtifactError(
            f"{model_dir}/config.json changed since {path} was exported; re-export, or pass the HF directory itself"
        )
    m = exported["model"]
    seq = _or(max_seq_len, m["max_seq_len"])
    # the export's cache layout: rings where it has them, for the same call size
    tree = bool(m.get("tree_verify")) if tree is None else tree
    if hidden_states is None:
        hidden_states = (m.get("hidden_states") or {}).get("layers")
    ring = min(m.get("cache_slots") or [m["max_seq_len"]]) < m["max_seq_len"] and not tree
    source = _load(model_dir, path, exported["tokenizer"], seq, _or(max_batch, m["max_batch"]), _or(dtype, m["dtype"]),
                   max_call_tokens=min(m["max_call_tokens"], seq) if ring else None, ring_cache=ring, tree=tree,
                   hidden_states=hidden_states)
    if source.manifest["model"]["tokenizer_fingerprint"] != m["tokenizer_fingerprint"]:
        raise ArtifactError(
            f"the tokenizer in {model_dir} differs from the one exported into {path}; re-export the model"
        )
    return source


def _load(model_dir: Path, path: Path, tokenizer_rel: str, max_seq_len: int, max_batch: int, dtype: str, *,
          max_call_tokens: int | None = None, ring_cache: bool = True, tree: bool = False,
          hidden_states=None) -> Source:
    config, spec, tokenizer, generation_config, hf = load_for_step(model_dir, max_seq_len, max_batch, dtype,
                                                                   TORCH_DTYPES)
    model = model_description(spec, config, generation_config, tokenizer, hf, max_seq_len, max_batch, dtype,
                              max_call_tokens=max_call_tokens, ring_cache=ring_cache)
    describe_tree_and_features(model, spec, tree, hidden_states)
    manifest = {
        "format": "trtspec-torch",  # in memory only: a torch engine is compiled at load time, never written
        "backend": "torch",
        "model": model,
        "tokenizer": tokenizer_rel,
        "source": {"model_dir": str(model_dir.resolve())},
    }
    return Source(hf, spec, path, manifest, find_gguf(model_dir), tokenizer)
