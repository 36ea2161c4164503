"""The torch engine's linear layers on a GGUF file's own blocks (trtspec/kernels), not on dequantized floats.

Each nn.Linear of the model that transformers loaded from the file is matched to the file's tensor (through
transformers' GGUF name map, with llama.cpp's rotary permutation of q/k undone where the weights say so), and is
replaced by a GGUFLinear whose kernel reads the file's blocks: its weights are the file's dequantization bit for bit
(checked here, layer by layer, before a layer is replaced). Layers of types the kernels do not take stay float.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from .. import kernels

log = logging.getLogger("trtspec.torch")


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ bias) with W a GGUF tensor's blocks in the kernels' layout."""

    def __init__(self, layer: kernels.Packed, bias: torch.Tensor | None, int8_activations: bool):
        super().__init__()
        self.register_buffer("packed", kernels.as_tensor(layer), persistent=False)
        self.in_features, self.out_features = layer.k, layer.n
        self.bits, self.group, self.zero, self.has_min = layer.bits, layer.group, layer.zero, layer.has_min
        self.half_scales, self.type_name = layer.half_scales, layer.type_name
        self.int8_activations = int8_activations
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x):
        # x [..., in] float32 -> [..., out]
        y = torch.ops.trtspec.gguf_linear(x, self.packed, self.out_features, self.in_features, self.bits, self.group,
                                          self.zero, self.has_min, self.half_scales, self.int8_activations)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"{self.type_name}, in_features={self.in_features}, out_features={self.out_features}, "
                f"int8_activations={self.int8_activations}")


class FusedGGUFLinear(GGUFLinear):
    """GGUF layers of one module that read the same input and share a block type, as one kernel call: their
    panels side by side (each layer's outputs fill whole panels), one rounding of the input instead of one each.
    forward returns their outputs in order; each column is computed as in its own layer, bit for bit."""

    def __init__(self, module: nn.Module, names: tuple[str, ...]):
        nn.Module.__init__(self)
        layers = [getattr(module, n) for n in names]
        first = layers[0]
        self.register_buffer("packed", torch.cat([lin.packed for lin in layers]), persistent=False)
        self.in_features, self.out_features = first.in_features, sum(lin.out_features for lin in layers)
        self.bits, self.group, self.zero, self.has_min = first.bits, first.group, first.zero, first.has_min
        self.half_scales, self.type_name, self.int8_activations = first.half_scales, first.type_name, first.int8_activations
        self.sizes = [lin.out_features for lin in layers]
        biases = [lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in layers]
        has_bias = any(lin.bias is not None for lin in layers)
        self.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if has_bias else None
        for n in names:
            delattr(module, n)

    def whole(self, x):
        """The layers' outputs side by side, unsplit."""
        return super().forward(x)

    def forward(self, x):
        return self.whole(x).split(self.sizes, dim=-1)


def fuse_gguf(module: nn.Module, names: tuple[str, ...]) -> FusedGGUFLinear | None:
    """StepModel's fuse_projections for the kernels' layers: one FusedGGUFLinear where the layers are all on the
    kernels, of one block type and input size, and every layer but the last fills whole panels; else None."""
    layers = [getattr(module, n) for n in names]
    if not all(type(lin) is GGUFLinear for lin in layers):
        return None
    same = {(lin.type_name, lin.in_features, lin.half_scales, lin.int8_activations) for lin in layers}
    if len(same) > 1 or any(lin.out_features % kernels.layout.PANEL for lin in layers[:-1]):
        return None
    return FusedGGUFLinear(module, names)


class RowwiseLinear(nn.Module):
    """nn.Linear as products and a sum per output: a row's result is the same bits whatever the call's number of
    rows (a matmul's kernel, and its order of additions, depends on it). For the float layers left beside the
    kernels in a build whose rows must not depend on the call (rowwise); inductor fuses it into one reduction."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x):
        y = (x[..., None, :] * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias


def _replace(hf: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(hf.get_submodule(parent_name) if parent_name else hf, child, module)


def use_gguf_kernels(hf: nn.Module, gguf_path: Path, spec, int8_activations: bool, rowwise: bool = False) -> dict:
    """Replace ``hf``'s linear layers by GGUFLinear on the file's blocks, in place; ``rowwise``: the layers left in
    float by RowwiseLinear.

    Returns {"kernels": {layer: type}, "float": {layer: why}}."""
    from ..exporter.gguf import file_blocks, tensors_by_hf_name

    kernels.load()
    tensors = tensors_by_hf_name(Path(gguf_path), hf)
    embed = hf.get_input_embeddings().weight
    embed_name = next((n for n, p in hf.named_parameters() if p is embed), None)
    done: dict[str, str] = {}
    left: dict[str, str] = {}
    for name, module in list(hf.named_modules()):
        if type(module) is not nn.Linear:
            continue
        t = tensors.get(f"{name}.weight")
        if t is None and module.weight is embed:  # a tied head: the embedding's tensor
            t = tensors.get(embed_name)
        found = "no tensor of the file found for it" if t is None else file_blocks(
            t, module.weight.detach().float().numpy(), spec.num_heads, spec.num_kv_heads)
        if isinstance(found, str):
            left[name] = found
            if rowwise:
                _replace(hf, name, RowwiseLinear(module))
            continue
        _replace(hf, name, GGUFLinear(kernels.pack(found[0]), module.bias, int8_activations))
        done[name] = found[0].type_name
    path = kernels.status().get("path", "torch")
    log.info("GGUF kernels: %d linear layers on the file's blocks%s; %s activations, the %s path", len(done),
             f"; {len(left)} left in float" if left else "", "int8" if int8_activations else "float", path)
    if done and not int8_activations:
        log.info("float activations keep the output closest to float32; --int8-activations builds the faster engine "
                 "(1.3-1.6x the plain decode on the development Xeon's paths, and on a CPU without AVX-512 about half "
                 "the time for a speculative verify call: docs/kernels.md, 'Int8 or float activations')")
    return {"kernels": done, "float": left}
