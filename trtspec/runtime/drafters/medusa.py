"""Drafting with Medusa heads on the target's last hidden state (trained by distill/heads.py; their layout:
heads/medusa.py). The heads run as a small onnxruntime graph of their own (HeadRunner): one [H] state -> K small
products per row, far below a target call; their candidates make a product tree, verified in one target call.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ...errors import ArtifactError
from .trees import pack_trees, product_tree
from .base import Drafter, Proposal
from .eagle3 import feature_columns

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


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


class MedusaDrafter(Drafter):
    """Drafting with Medusa heads on the target's last hidden state (heads/medusa.py).

    After each target call the scheduler hands over the features of the verified positions (``observe``); the
    last one, at position n - 2, predicted the row's last token n - 1 through the target's lm_head, and head i
    guesses token n + i. A round's tree is the Cartesian product of each head's top choices grown best-first by
    the product of their probabilities (drafters/trees.product_tree) up to ``tree_nodes`` nodes; a target exported
    without --tree gets the chain of each head's first choice. No draft engine, no cache: prefixes reuse freely.
    """

    name = "medusa"
    proposes_drafts = True
    reads_features = True  # (its heads run in a small graph of their own: no draft engine)
    proposes_trees = True

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes):
        return cls(draft, target, tree_nodes=tree_nodes)
    TOP = (4, 3, 2, 2, 2, 2, 2, 2)  # candidates per head, nearest first (a node's budget goes best-first anyway)

    def __init__(self, heads, target, *, tree_nodes: int | None = None):
        self.heads = heads if isinstance(heads, HeadRunner) else HeadRunner(heads)
        model = target.manifest["model"]
        if self.heads.vocab != target.vocab_size or self.heads.hidden * 1 != _hidden_size(target):
            raise ArtifactError(f"these Medusa heads are for a model of hidden size {self.heads.hidden} and "
                                f"{self.heads.vocab} tokens, not this target")
        self.columns = feature_columns(model, [model["num_layers"]], self.heads.hidden, "Medusa")
        self.tree = bool(getattr(target, "tree_verify", False))
        self.tree_nodes = tree_nodes or 16
        rows = target.max_batch
        self.known = np.zeros(rows, np.int64)
        self.last = np.zeros((rows, self.heads.hidden), np.float32)

    def admit(self, row, prefix, n):
        self.known[row] = n  # (the last prompt token is always read: its features come then)

    def reusable(self, prefix):
        return 1 << 62

    def save_prefix(self, row, n):
        return None

    def observe(self, first_row, starts, features):
        for i, (start, f) in enumerate(zip(starts, features)):
            if len(f) and start <= self.known[first_row + i]:
                self.known[first_row + i] = start + len(f)
                self.last[first_row + i] = f[-1][self.columns]

    def accepted(self, valid):
        pass

    def move_row(self, src, dst):
        self.known[dst] = self.known[src]
        self.last[dst] = self.last[src]

    def propose(self, tokens, n, caps, samplers, capacity):
        b = n.size
        ready = (self.known[:b] == n - 1) & (caps > 0)
        depth = np.where(ready, np.minimum(caps, self.heads.num_heads), 0)
        if not depth.any():
            return Proposal(np.zeros((b, 0), np.int64), np.zeros(b, np.int64))
        t0 = time.perf_counter()
        top = self.heads.top(self.last[:b], max(self.TOP[: int(depth.max())]))
        trees = []
        for r in range(b):
            d = int(depth[r])
            if not self.tree:
                trees.append(([int(top[j][0][r, 0]) for j in range(d)], list(range(-1, d - 1))))
                continue
            cands = [list(zip(top[j][0][r, : self.TOP[j]].tolist(), top[j][1][r, : self.TOP[j]].tolist()))
                     for j in range(d)]
            trees.append(tuple(product_tree(cands, min(self.tree_nodes, int(caps[r]) * 4))))
        drafts, parents, counts = pack_trees(trees, self.tree_nodes)
        calls = [(b, 1, time.perf_counter() - t0)]
        if not self.tree:
            return Proposal(drafts, counts, None, calls)
        return Proposal(drafts, counts, None, calls, parents, f"medusa{self.tree_nodes}")


def _hidden_size(engine) -> int:
    model = engine.manifest["model"]
    hs = model.get("hidden_states") or {}
    layers = hs.get("layers") or [None]
    return hs.get("size", 0) // len(layers)


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
