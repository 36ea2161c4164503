"""Medusa heads: K small heads on the target's last hidden state, head i guessing the token i + 2 ahead.

Each head is a residual block, x + SiLU(W x + b), and an lm_head; the target's own lm_head gives the token
1 ahead. Layout (config.json + model.safetensors), the Medusa authors' key names:

    medusa_head.{i}.0.linear.weight [H, H], medusa_head.{i}.0.linear.bias [H]   the residual block
    medusa_head.{i}.1.weight [V_head, H]                                         the head's lm_head

with config ``medusa_num_heads``, ``medusa_num_layers`` (1), ``hidden_size``, ``vocab_size`` and, for heads over a
reduced vocabulary (trtspec's default: the most frequent tokens of the training text), ``draft_vocab_size`` and
``d2t`` in the weights (target id = head id + d2t[head id]). Drafting runs the heads as a small onnxruntime
graph (runtime/drafters/medusa.HeadRunner): one [H] state -> K small products per row, far below a target call.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.drafters.medusa import CONFIG, WEIGHTS, HeadRunner

__all__ = ["CONFIG", "WEIGHTS", "HeadRunner", "make_heads", "save_heads"]


def make_heads(hidden: int, vocab: int, draft_vocab: int, num_heads: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(hidden, hidden)
            nn.init.zeros_(self.linear.weight)  # starts as the identity: each head begins as the target's lm_head

        def forward(self, x):
            return x + F.silu(self.linear(x))

    class MedusaHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"architectures": ["MedusaHeads"], "medusa_num_heads": num_heads, "medusa_num_layers": 1,
                           "hidden_size": hidden, "vocab_size": vocab, "draft_vocab_size": draft_vocab}
            self.medusa_head = nn.ModuleList(
                [nn.Sequential(ResBlock(), nn.Linear(hidden, draft_vocab, bias=False)) for _ in range(num_heads)])
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))

        def forward(self, hidden_states):
            # [B, S, H] -> one logits tensor [B, S, V_head] per head
            return [head(hidden_states) for head in self.medusa_head]

    return MedusaHeads()


def save_heads(heads, path) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in heads.state_dict().items()}, str(path / WEIGHTS))
    (path / CONFIG).write_text(json.dumps(heads.config, indent=2))
