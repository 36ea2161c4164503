"""Medusa heads: K small heads on the target's last hidden state, head i guessing the token i + 2 ahead.

Each head is a residual block, x + SiLU(W x + b), and an lm_head; the target's own lm_head gives the token
1 ahead. Layout (config.json + model.safetensors), the Medusa authors' key names:

    medusa_head.{i}.0.linear.weight [H, H], medusa_head.{i}.0.linear.bias [H]   the residual block
    medusa_head.{i}.1.weight [V_head, H]                                         the head's lm_head

with config ``medusa_num_heads``, ``medusa_num_layers`` (1), ``hidden_size``, ``vocab_size`` and, for heads over a
reduced vocabulary (trtspec's default: the most frequent tokens of the training text), ``draft_vocab_size`` and
``d2t`` in the weights (target id = head id + d2t[head id]). Drafting runs the heads as a small onnxruntime
graph (HeadRunner): one [H] state -> K small products per row, far below a target call.
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


class HeadRunner:
    """The heads for drafting: ``top(hidden [B, H], k)`` -> per head (target ids [B, k], log-probabilities [B, k]).

    They run as a small onnxruntime graph on one thread without spinning: numpy's BLAS would start threads of
    its own for these products, whose spinning between calls took the cores from the target's next call (a
    9-token verify measured 5.3 ms instead of 4.0 on the bundled target)."""

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
        self._sessions: dict[int, object] = {}  # k -> session

    def _session(self, k: int):
        if k not in self._sessions:
            import onnxruntime as ort
            from onnx import TensorProto, helper, numpy_helper

            nodes, inits, outputs = [], [], []
            for i, ((w, b), lm) in enumerate(zip(self.blocks, self.heads)):
                inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}"),
                          numpy_helper.from_array(lm, f"lm{i}")]
                nodes += [helper.make_node("MatMul", ["hidden", f"w{i}"], [f"x{i}"]),
                          helper.make_node("Add", [f"x{i}", f"b{i}"], [f"xb{i}"]),
                          helper.make_node("Sigmoid", [f"xb{i}"], [f"s{i}"]),
                          helper.make_node("Mul", [f"xb{i}", f"s{i}"], [f"silu{i}"]),
                          helper.make_node("Add", ["hidden", f"silu{i}"], [f"r{i}"]),
                          helper.make_node("MatMul", [f"r{i}", f"lm{i}"], [f"logits{i}"]),
                          helper.make_node("LogSoftmax", [f"logits{i}"], [f"lp{i}"], axis=-1),
                          helper.make_node("TopK", [f"lp{i}", "k"], [f"values{i}", f"indices{i}"], axis=-1)]
                outputs += [helper.make_tensor_value_info(f"values{i}", TensorProto.FLOAT, None),
                            helper.make_tensor_value_info(f"indices{i}", TensorProto.INT64, None)]
            inits.append(numpy_helper.from_array(np.array([min(k, self.heads[0].shape[1])], np.int64), "k"))
            graph = helper.make_graph(nodes, "medusa", [helper.make_tensor_value_info(
                "hidden", TensorProto.FLOAT, [None, self.hidden])], outputs, inits)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            so.inter_op_num_threads = 1
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.log_severity_level = 3
            self._sessions[k] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return self._sessions[k]

    def top(self, hidden: np.ndarray, k: int):
        res = self._session(k).run(None, {"hidden": np.ascontiguousarray(hidden, np.float32)})
        return [(self.to_target[res[2 * i + 1]], res[2 * i]) for i in range(self.num_heads)]


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
