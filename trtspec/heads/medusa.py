"""Medusa heads: K small heads on the target's last hidden state, head i guessing the token i + 2 ahead.

Each head is a residual block, x + SiLU(W x + b), and an lm_head; the target's own lm_head gives the token
1 ahead. Layout (config.json + model.safetensors), the Medusa authors' key names:

    medusa_head.{i}.0.linear.weight [H, H], medusa_head.{i}.0.linear.bias [H]   the residual block
    medusa_head.{i}.1.weight [V_head, H]                                         the head's lm_head

with config ``medusa_num_heads``, ``medusa_num_layers`` (1), ``hidden_size``, ``vocab_size`` and, for heads over a
reduced vocabulary (trtspec's default: the most frequent tokens of the training text), ``draft_vocab_size`` and
``d2t`` in the weights (target id = head id + d2t[head id]). Drafting runs the heads in numpy: one [H] state ->
K small matmuls per row, far below a target call.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import ArtifactError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


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


class NumpyHeads:
    """The heads for drafting: ``top(hidden [B, H], k)`` -> per head (target ids [B, k], log-probabilities [B, k])."""

    def __init__(self, path):
        path = Path(path)
        if not (path / CONFIG).is_file():
            raise ArtifactError(f"{path} has no {CONFIG}; a Medusa head directory has config.json and its weights")
        config = json.loads((path / CONFIG).read_text())
        if "medusa_num_heads" not in config:
            raise ArtifactError(f"{path} is not a Medusa head directory (no medusa_num_heads in its config)")
        if int(config.get("medusa_num_layers", 1)) != 1:
            raise ArtifactError(f"{path}: heads of {config['medusa_num_layers']} residual blocks are not supported (1 is)")
        state = _load(path)
        self.num_heads = int(config["medusa_num_heads"])
        self.hidden = int(config["hidden_size"])
        self.vocab = int(config["vocab_size"])
        self.blocks, self.heads = [], []
        for i in range(self.num_heads):
            try:
                w, b = state[f"medusa_head.{i}.0.linear.weight"], state[f"medusa_head.{i}.0.linear.bias"]
                lm = state[f"medusa_head.{i}.1.weight"]
            except KeyError as e:
                raise ArtifactError(f"{path}: {e.args[0]} missing from the Medusa weights") from None
            self.blocks.append((np.ascontiguousarray(w.T, np.float32), b.astype(np.float32)))
            self.heads.append(np.ascontiguousarray(lm.T, np.float32))
        size = self.heads[0].shape[1]
        d2t = state.get("d2t")
        self.to_target = np.arange(size) + (d2t.astype(np.int64) if d2t is not None else 0)
        if self.to_target.max() >= self.vocab:
            raise ArtifactError(f"{path}: its vocabulary map points past the model's {self.vocab} tokens")

    def top(self, hidden: np.ndarray, k: int):
        out = []
        for (w, b), lm in zip(self.blocks, self.heads):
            x = hidden @ w + b
            x = hidden + x / (1.0 + np.exp(-x))
            logits = x @ lm
            logits -= logits.max(-1, keepdims=True)
            lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            idx = np.argpartition(-lp, k - 1, axis=-1)[:, :k] if k < lp.shape[-1] else np.tile(np.arange(lp.shape[-1]), (lp.shape[0], 1))
            vals = np.take_along_axis(lp, idx, -1)
            order = np.argsort(-vals, -1, kind="stable")
            out.append((self.to_target[np.take_along_axis(idx, order, -1)], np.take_along_axis(vals, order, -1)))
        return out


def _load(path: Path) -> dict:
    if (path / WEIGHTS).is_file():
        from safetensors.numpy import load_file

        return {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in load_file(str(path / WEIGHTS)).items()}
    if (path / "medusa_lm_head.pt").is_file() or (path / "pytorch_model.bin").is_file():
        import torch

        f = path / "medusa_lm_head.pt" if (path / "medusa_lm_head.pt").is_file() else path / "pytorch_model.bin"
        return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
                for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise ArtifactError(f"{path} has no {WEIGHTS} (or medusa_lm_head.pt)")
