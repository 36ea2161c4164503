"""StepModel with its KV cache as fixed buffers: the module the torch engine compiles."""

from __future__ import annotations

import types

import torch
from torch import nn


class CachedStep(nn.Module):
    """forward(input_ids, position_ids) -> logits; writes K/V into this module's cache buffers in place."""

    def __init__(self, step: nn.Module, max_batch: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.step = step
        spec = step.spec
        self.num_caches = 2 * spec.num_layers
        for i in range(self.num_caches):  # key_0, value_0, key_1, ...; S_max slots, or a sliding-window layer's ring
            shape = (max_batch, spec.num_kv_heads, step.cache_slots[i // 2], spec.head_dim)
            self.register_buffer(f"cache_{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, f"cache_{i}") for i in range(self.num_caches)]

    def forward(self, input_ids, position_ids, tree_mask=None, live=None):
        # input_ids [B, T] int64, position_ids [B, T] int64[, tree_mask [B, T, T] bool: a tree call]
        # live [L]: attend only the first L slots of the full-length caches (L > every slot the call reads or writes;
        # a chain call's only); its length is what counts, so L stays a dynamic size, not a recompile
        # -> (logits [B, T, V], hidden_states [B, T, F] or None); writes cache rows [0, B)
        b = input_ids.shape[0]
        caches = [c[:b] for c in self.caches()]  # (the step cuts the live slots after its write: StepModel.forward)
        return split_outputs(self.step, self.step(input_ids, position_ids, *tree_args(self.step, tree_mask), *caches,
                                                  live=None if live is None else live.shape[0]))[:2]


def tree_args(step, tree_mask) -> tuple:
    """The step's tree_mask argument: one where the step verifies trees, none otherwise."""
    return (tree_mask,) if step.tree else ()


def split_outputs(step, out) -> tuple:
    """A step's outputs -> (logits, hidden_states or None, presents)."""
    if step.hidden_layers:
        return out[0], out[1], out[2:]
    return out[0], None, out[1:]


def own_forward(module: CachedStep):
    """module.forward over a private copy of its code object.

    Dynamo keeps its compiled graphs, and its recompile limit (8), per code object.
    Shared by every engine in a process (target and draft, eager and inductor),
    the few graphs each engine needs would add up past the limit; a copy per
    compiled callable keeps each engine's cache to its own at most 4 graphs.
    """
    fn = CachedStep.forward
    code = fn.__code__.replace()
    return types.MethodType(types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__), module)
