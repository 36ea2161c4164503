"""Compile csrc/ with the machine's C++ compiler into one shared library of torch ops, once, and cache it.

The cache key is everything the binary depends on: our sources, the compiler's version, torch's version and ABI.
The library lands in ``$TRTSPEC_CACHE`` (default ``~/.cache/trtspec``)/kernels/<key>/, written to a temporary
name and renamed, under a file lock, so two processes building at once never load half a library. The compiler is
``$TRTSPEC_CXX``, else ``$CXX``, else ``c++``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("trtspec.kernels")

SOURCES = Path(__file__).parent / "csrc"
LIBRARY = "libtrtspec_kernels.so"
# -ffp-contract=off: no multiply-add may be fused where the source has two operations (gguf_linear.h's int8 path
# is specified without them; the float path and attention ask for theirs explicitly, the same on every path)
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden", "-Wall",
         "-Wno-unused-function"]


class CompilerMissing(RuntimeError):
    pass


def compiler() -> str:
    return os.environ.get("TRTSPEC_CXX") or os.environ.get("CXX") or "c++"


def cache_root() -> Path:
    return Path(os.environ.get("TRTSPEC_CACHE") or Path.home() / ".cache" / "trtspec")


def _run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise CompilerMissing(f"no C++ compiler at {cmd[0]!r}") from None
    if done.returncode:
        raise RuntimeError(f"compiling the GGUF kernels failed ({' '.join(cmd[:3])} ...):\n{done.stderr[-4000:]}")


def _key(cxx: str) -> str:
    import torch

    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except (FileNotFoundError, PermissionError):
        raise CompilerMissing(f"no C++ compiler at {cxx!r}") from None
    h = hashlib.sha256()
    for f in sorted(SOURCES.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    h.update(f"{version}|{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{FLAGS}".encode())
    return h.hexdigest()[:16]


def library(progress=sys.stderr) -> Path:
    """The compiled library's path, building it first if this machine has none yet."""
    from torch.utils import cpp_extension

    cxx = compiler()
    out = cache_root() / "kernels" / _key(cxx)
    lib = out / LIBRARY
    if lib.is_file():
        return lib
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():  # built by another process while we waited
            return lib
        if progress is not None:
            print(f"trtspec: compiling the GGUF kernels with {cxx} (once per machine, about a minute) ...",
                  file=progress, flush=True)
        import torch

        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            sources = sorted(SOURCES.glob("*.cpp"))
            objects = [Path(tmp) / (s.stem + ".o") for s in sources]
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                list(pool.map(_run, [[cxx, *FLAGS, abi, *includes, "-c", str(s), "-o", str(o)]
                                     for s, o in zip(sources, objects)]))
            torch_lib = cpp_extension.library_paths()[0]
            tmp_lib = Path(tmp) / LIBRARY
            _run([cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(tmp_lib), f"-L{torch_lib}",
                  f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch"])
            os.replace(tmp_lib, lib)
    return lib


def clear_cache() -> None:
    shutil.rmtree(cache_root() / "kernels", ignore_errors=True)


if __name__ == "__main__":  # `python trtspec/kernels/build.py`: compile now, as soon as torch is installed
    library(progress=None)
