"""Artifact directories: one manifest.json each, written atomically, verified on load.

A manifest says what an artifact is (``format``), what it contains (``files``:
relative path -> sha256) and how it was made. Every stage reads only the
manifest and the files it names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ArtifactError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
EXPORT_FORMAT = "trtspec-export"
ENGINE_FORMAT = "trtspec-engine"
KINDS = (EXPORT_FORMAT, ENGINE_FORMAT)
DRAFT_TO_TARGET = "draft_to_target.npy"  # an exported head's draft id -> target id map (heads/export.py writes it)
# what the runtime reads from an artifact besides its graph and tokenizer: an engine built from an export carries it
CARRIED_FILES = (DRAFT_TO_TARGET,)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def versions(*modules: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("trtspec", *modules):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


@contextlib.contextmanager
def atomic_artifact(out_dir: str | os.PathLike, manifest: dict):
    """Yield a temp dir to fill; on success hash its files, write the manifest and move it to out_dir.

    ``manifest`` may be completed by the caller inside the block. An existing
    trtspec artifact at out_dir is replaced; any other existing non-empty
    directory is refused, so a typo cannot wipe user data. An exception inside
    the block leaves out_dir as it was.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise ArtifactError(
            f"{out} exists and is not a trtspec artifact; refusing to overwrite it. Choose another output path."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        manifest["format_version"] = FORMAT_VERSION
        manifest["files"] = {
            p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def carry_files(export_dir: Path, export_manifest: dict, out: Path) -> None:
    """Copy an export's tokenizer and CARRIED_FILES into the engine being built in ``out``."""
    shutil.copytree(export_dir / export_manifest["tokenizer"], out / export_manifest["tokenizer"])
    for name in CARRIED_FILES:
        if name in export_manifest["files"]:
            shutil.copy2(export_dir / name, out / name)


def export_source(export_dir: Path) -> dict:
    """The ``source`` block of an engine manifest: which export it was built from, by manifest hash, and the HF
    model directory the export was made from (so an engine still names it after its export has moved)."""
    source = {
        "export_dir": str(Path(export_dir).resolve()),
        "export_manifest_sha256": sha256_file(Path(export_dir) / MANIFEST),
    }
    try:
        model_dir = (json.loads((Path(export_dir) / MANIFEST).read_text()).get("source") or {}).get("model_dir")
    except (OSError, ValueError, AttributeError):
        model_dir = None
    if model_dir:
        source["model_dir"] = model_dir
    return source


def read_manifest(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """Read and check an artifact's manifest; raise ArtifactError saying what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory; pass an export/ or engines/ artifact directory")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(
            f"{root} has no {MANIFEST}: it is not a trtspec artifact. Create one with `trtspec export` or `trtspec build`."
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath} is not valid JSON ({e}); re-run the export or build that made it") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in KINDS:
        raise ArtifactError(f"{mpath} is not a trtspec manifest (format is not one of {', '.join(KINDS)})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{mpath} has format_version {manifest.get('format_version')!r}; this trtspec reads version "
            f"{FORMAT_VERSION}. Re-export with this version."
        )
    if verify:
        for rel, digest in manifest.get("files", {}).items():
            f = root / rel
            if not f.is_file():
                raise ArtifactError(f"{root}: file {rel} named in the manifest is missing; re-run the export/build")
            if sha256_file(f) != digest:
                raise ArtifactError(
                    f"{root}: {rel} does not match the sha256 in its manifest (truncated, edited or replaced); "
                    "re-run the export/build that made it"
                )
    return manifest
