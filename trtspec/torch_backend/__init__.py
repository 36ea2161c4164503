"""The torch.compile path (DESIGN.md §3, torch): the step contract as a compiled torch module.

compile() turns an HF model directory (or the model behind an export/) into an
engine with the onnxruntime/TensorRT engines' protocol. Importing
``trtspec.torch_backend.dynamo_backend`` registers the "trtspec" torch.compile
backend (compile() imports it too).
"""

from .engine import TorchEngine, compile

__all__ = ["TorchEngine", "compile"]
