"""Which TensorRT and GPU a plan needs: the lazy import, the GPU's compute capability, the load-time check.

A serialized TensorRT plan runs only on the TensorRT version that built it
and on GPUs of the same compute capability (TensorRT's engine compatibility
rules, without the opt-in version/hardware compatibility modes, which we do
not use). The engine manifest records both; loading elsewhere is refused here
before TensorRT is asked to deserialize anything.
"""

from __future__ import annotations

from ..errors import ArtifactError, BackendUnavailableError

INSTALL_HINT = (
    "install TensorRT 11 for Python (`pip install tensorrt` from NVIDIA's index, matching your CUDA) on a machine "
    "with an NVIDIA GPU and driver; otherwise use --backend onnxruntime"
)


def import_tensorrt():
    """The tensorrt module, or BackendUnavailableError saying how to get it."""
    try:
        import tensorrt
    except Exception as e:  # ImportError, or OSError/RuntimeError when the bindings cannot find the libraries
        raise BackendUnavailableError(f"the TensorRT backend needs the tensorrt package, which failed to import ({e}); {INSTALL_HINT}") from None
    return tensorrt


def compute_capability() -> str:
    """The current CUDA device's compute capability as "major.minor", via torch (CUDA build) or cuda-python."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor}"
    except ImportError:
        pass
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise BackendUnavailableError(
            "no CUDA device found: the TensorRT backend needs an NVIDIA GPU, and a CUDA build of torch or "
            "the cuda-python package (`pip install cuda-python`) to reach it"
        ) from None
    attrs = (cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor)
    values = []
    for attr in attrs:
        err, value = cudart.cudaDeviceGetAttribute(attr, 0)
        if int(err) != 0:
            raise BackendUnavailableError(f"no usable CUDA device ({err}); the TensorRT backend needs an NVIDIA GPU")
        values.append(value)
    return f"{values[0]}.{values[1]}"


def check_plan_compatible(manifest: dict, tensorrt_version: str, capability: str, path="the engine") -> None:
    """Refuse a plan built by another TensorRT version or for another GPU compute capability."""
    built = manifest.get("tensorrt", {})
    if built.get("version") != tensorrt_version:
        raise ArtifactError(
            f"{path} was built with TensorRT {built.get('version')} but TensorRT {tensorrt_version} is installed; "
            "a TensorRT plan loads only on the version that built it. Rebuild it here with "
            "`trtspec build --backend tensorrt` from its export directory"
        )
    if built.get("compute_capability") != capability:
        raise ArtifactError(
            f"{path} was built for GPUs of compute capability {built.get('compute_capability')} but this GPU has "
            f"{capability}; rebuild it on this GPU with `trtspec build --backend tensorrt`"
        )
