"""The onnxruntime engine: the step graph run with IOBinding, the KV cache updated in place.

Each layer's cache is one numpy buffer [max_batch, Hkv, slots, D] (slots: S_max, or a sliding-window
layer's ring), allocated once. Every call binds past_* and present_* to the same address, so
onnxruntime's TensorScatter (declared MayInplace) writes the new K/V straight
into it: no per-call copy and no per-call allocation of the cache. A call
with B < max_batch rows binds the first B rows, which are contiguous.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..engine_contract import fuses_qdq
from ..exporter.contract import max_call_tokens, slots_by_input
from ..exporter.contract import HIDDEN_STATES, TREE_MASK
from ..ort_session import session_options
from .base import CacheRows, CallGuard, chain_mask, check_call, check_greedy_steps, ring_rows

_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class _Binding:
    """An IOBinding of one session with the buffers bound to it: inputs and logits for one call shape (B, T),
    and the cache rows it reads and writes."""

    def __init__(self, session):
        self.io = session.io_binding()
        self.rows = None  # (first_row, B) of the bound cache rows
        self.shape = None  # (B, T) of the bound inputs and logits
        self.ids = self.pos = self.logits = None
        self.tree = None  # the bound tree_mask (graphs with one), and whether it holds the causal (chain) mask
        self.causal = False
        self.features = None  # the bound hidden_states output (graphs with one)
        self.extra = {}  # a draft head's bound extra inputs


class _Graph:
    """One onnxruntime session over the engine's cache buffers.

    Binding costs more than a decode call's own Python: a call of the shape of the last one only copies its ids
    in. Speculation alternates shapes every round (a draft's catch-up call and its one-token calls, the target's
    k + 1-token verify), so each recent small shape keeps a binding of its own (least recently used dropped past
    SMALL_BINDINGS); larger calls share one binding, rebound when their shape changes.
    """

    SMALL_BINDINGS = 8
    SMALL_LOGITS_BYTES = 4 << 20  # a call whose logits fit in this keeps its binding (and its logits buffer)

    def __init__(self, path: Path, options):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.tree = TREE_MASK in {i.name for i in self.session.get_inputs()}
        self.small: OrderedDict[tuple[int, int], _Binding] = OrderedDict()
        self.other = _Binding(self.session)


class OnnxRuntimeEngine(CacheRows):
    """The step graph on onnxruntime's CPU provider. Not thread-safe: see engines/base.py (Engine).

    An engine built with fusion may hold a second graph, ``decode.onnx`` (builder/ort_decode.py), that runs
    every call of one row or one token; the built graph then runs only the others (several rows x several
    tokens), loaded at the first such call. Both read and write the same cache buffers.

    An exact int8 build (``build.min_call_tokens`` > 1) runs one graph for every call instead, so that a row's
    logits are the same in every call: the built graph, or, once ``plan_rows(1)`` says every call will carry
    one row (a Scheduler of max_batch 1), its decode graph, whose attention reads the cache in place where the
    built graph copies each layer's live keys and values first (a decode call 7.7-7.8 against 8.5-9.0 ms at 100
    tokens of context, about the same at 900: benchmarks/bench_int8_exact.py).
    """

    backend = "onnxruntime"

    def __init__(self, path: Path, manifest: dict, *, num_threads: int | None = None):
        self.path = Path(path)
        self.manifest = manifest
        model = manifest["model"]
        # an int8-activation build runs every call with at least min_call_tokens tokens a row (engine_contract.py:
        # EXACT_MIN_CALL_TOKENS): a shorter call gets pad tokens after its own, which need the slots after them
        self.min_call_tokens = int(manifest.get("build", {}).get("min_call_tokens", 1))
        self.max_seq_len = model["max_seq_len"] - (self.min_call_tokens - 1)
        self.max_batch = model["max_batch"]
        self.vocab_size = model["vocab_size"]
        self.dtype = _NP_DTYPES[model["dtype"]]
        self._options = session_options(num_threads, fuse_qdq=fuses_qdq(manifest))
        decode = (manifest.get("build", {}).get("decode_graph") or {}).get("graph")
        self._one_row = False  # an exact build planned for one row a call (plan_rows): its decode graph for every call
        if self.min_call_tokens > 1:  # one graph loaded at a time: the built one until a plan says one row
            self._decode_path = self.path / decode if decode else None
            self._decode, self._full = None, self._built_graph()
        else:
            self._decode = _Graph(self.path / decode, self._options) if decode else None
            self._full = None if self._decode else self._built_graph()
        self._logits_dtype = self.dtype
        self.logits_size = model.get("logits_size", self.vocab_size)  # a draft head's own vocabulary
        self.extra_inputs = dict(model.get("extra_inputs") or {})  # name -> last dim: a head's float inputs [B, T, n]
        self.tree_verify = bool(model.get("tree_verify"))
        self.features_size = (model.get("hidden_states") or {}).get("size")
        self.features = None  # the last call's hidden_states output [B, T, features_size] (graphs exported with it)
        self.max_call_tokens = max_call_tokens(model)
        if self.min_call_tokens > 1 and (self.tree_verify or self.extra_inputs):
            raise ValueError(f"{self.path}: build.min_call_tokens with tree verification or a head's extra inputs is no "
                             "build trtspec makes; rebuild the engine with `trtspec build`")
        self._rings = ring_rows(model, self.max_batch)
        self._aliases = list(model["kv_aliases"].items())  # (present, past)
        self.cache = {past: np.zeros((self.max_batch, model["num_kv_heads"], slots, model["head_dim"]), dtype=self.dtype)
                      for past, slots in slots_by_input(model).items()}
        self._logits = np.empty(0, dtype=self._logits_dtype)  # grows to the largest B*T*V seen, then reused
        self._guard = CallGuard(str(self.path))

    @property
    def session(self):
        """The session that runs a one-token call (the decode graph where the engine has one)."""
        return self._graph_for(1, self.min_call_tokens).session

    def plan_rows(self, rows: int) -> None:
        """The most rows each call will carry from now on (a Scheduler's max_batch), before its first call. Only an
        exact int8 build with a decode graph takes it: one row, that graph for every call (a call of more rows
        is then refused); more, the built graph for every call. Either way each row's logits are the same in every
        call of the plan; between plans they differ (another attention kernel), so a plan starts with new rows."""
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= self.max_batch:
            raise ValueError(f"rows must be an integer in [1, {self.max_batch}] (the engine's rows), got {rows!r}")
        if self.min_call_tokens <= 1:
            return
        with self._guard:
            self._one_row = rows == 1 and self._decode_path is not None
            if self._one_row and self._decode is None:
                self._decode, self._full = _Graph(self._decode_path, self._options), None
            elif not self._one_row and self._full is None:
                self._full, self._decode = self._built_graph(), None

    def _built_graph(self) -> _Graph:
        return _Graph(self.path / self.manifest["graph"], self._options)

    def _graph_for(self, b: int, t: int, tree: bool = False) -> _Graph:
        if self.min_call_tokens > 1:  # an exact build: the plan's one graph for every call
            if not self._one_row:
                return self._full
            if b > 1:
                raise ValueError(f"{self.path}: a call of {b} rows on an engine planned for one row a call "
                                 "(plan_rows(1), a Scheduler of max_batch 1); plan for more rows first")
            return self._decode
        if self._decode is not None and (b == 1 or t == 1) and not tree:
            return self._decode
        if self._full is None:
            self._full = self._built_graph()
        return self._full

    def _binding(self, g: _Graph, b: int, t: int) -> _Binding:
        """The binding for a call of B rows x T tokens, its inputs and logits bound."""
        if b * t * self.logits_size * self._logits.itemsize > g.SMALL_LOGITS_BYTES:
            bd = g.other
            if (b, t) != bd.shape or bd.logits.base is not self._logits:
                self._bind_io(g, bd, b, t, shared=True)
            return bd
        bd = g.small.get((b, t))
        if bd is None:
            bd = g.small[(b, t)] = _Binding(g.session)
            self._bind_io(g, bd, b, t, shared=False)
            if len(g.small) > g.SMALL_BINDINGS:
                g.small.popitem(last=False)
        else:
            g.small.move_to_end((b, t))
        return bd

    def _bind_cache(self, bd: _Binding, rows: tuple[int, int]):
        # Rebinding is needed only when the rows change: rows [first, first + b) are contiguous in each buffer.
        first, b = rows
        for present, past in self._aliases:
            buf = self.cache[past]
            shape = [b, *buf.shape[1:]]
            ptr = buf.ctypes.data + first * buf.strides[0]
            bd.io.bind_input(past, "cpu", 0, self.dtype, shape, ptr)
            bd.io.bind_output(present, "cpu", 0, self.dtype, shape, ptr)
        bd.rows = rows

    def forward(self, input_ids, position_ids, first_row: int = 0, tree_mask=None, inputs=None):
        # input_ids [B, T] int64, position_ids [B, T] int64 -> logits [B, T, V]; cache rows [first_row, first_row + B)
        # tree_mask [B, T, T] bool: a tree call (engines exported with tree verification; contract.py).
        # inputs: {name: [B, T, n] float} for a draft head's extra inputs (zeros where one is not given).
        # The returned array is a reused buffer: valid until the next call of the same shape.
        input_ids, position_ids, tree_mask = check_call(self, input_ids, position_ids, first_row, tree_mask)
        tree = tree_mask is not None
        t_asked = input_ids.shape[1]
        if t_asked < self.min_call_tokens:
            input_ids, position_ids = self._pad(input_ids, position_ids)
        b, t = input_ids.shape
        with self._guard:
            g = self._graph_for(b, t, tree)
            bd = self._binding(g, b, t)
            if (first_row, b) != bd.rows:
                self._bind_cache(bd, (first_row, b))
            np.copyto(bd.ids, input_ids)
            np.copyto(bd.pos, position_ids)
            for name, buf in bd.extra.items():
                value = None if inputs is None else inputs.get(name)
                if value is None:
                    buf.fill(0)
                else:
                    np.copyto(buf, value)
            if tree:
                np.copyto(bd.tree, tree_mask)
                bd.causal = False
            elif bd.tree is not None and not bd.causal:
                bd.tree[:] = np.tril(np.ones((t, t), bool))
                bd.causal = True
            g.session.run_with_iobinding(bd.io)
            self.features = bd.features if t == t_asked or bd.features is None else bd.features[:, :t_asked]
            if self._rings is not None:
                self._rings.wrote(first_row, position_ids)
        return bd.logits if t == t_asked else bd.logits[:, :t_asked]

    def _pad(self, input_ids, position_ids):
        """A call of fewer than min_call_tokens tokens a row, padded to that many: each row's last token again at
        the next positions (their cache writes land where the mask hides them until the next call overwrites them).
        Such engines verify no trees and take no extra inputs (checked when loaded)."""
        pad = self.min_call_tokens - input_ids.shape[1]
        input_ids = np.concatenate([input_ids, np.repeat(input_ids[:, -1:], pad, 1)], 1)
        position_ids = np.concatenate([position_ids, position_ids[:, -1:] + np.arange(1, pad + 1)], 1)
        return input_ids, position_ids

    def greedy_steps(self, row: int, token: int, position: int, steps: int, on_token, pick=None
                     ) -> tuple[int, float]:
        """engines.base.greedy_steps for this engine: one row, one token per call, in a loop that only writes
        the token and its position into the bound inputs, runs, and takes the argmax or ``pick``'s token (checked
        once, up front)."""
        if steps < 1:
            return 0, 0.0
        check_greedy_steps(self, row, token, position, steps)
        seconds = 0.0
        clock = time.perf_counter
        t = self.min_call_tokens  # (each call's token and its pads: the token again at the next positions)
        with self._guard:
            g = self._graph_for(1, t)
            bd = self._binding(g, 1, t)
            if (row, 1) != bd.rows:
                self._bind_cache(bd, (row, 1))
            if bd.tree is not None and not bd.causal:
                bd.tree[:] = np.tril(np.ones((t, t), bool))
                bd.causal = True
            self.features = bd.features
            ids, pos, logits, run, binding = bd.ids, bd.pos, bd.logits[0, 0], g.session.run_with_iobinding, bd.io
            try:
                for i in range(steps):
                    ids[0, :] = token
                    pos[0, :] = range(position + i, position + i + t)
                    t0 = clock()
                    run(binding)
                    seconds += clock() - t0
                    token = int(logits.argmax()) if pick is None else pick(logits, i)
                    if not on_token(token):
                        return i + 1, seconds
            finally:
                if self._rings is not None:  # the calls wrote up to the last bound position
                    self._rings.wrote(row, pos)
        return steps, seconds

    def _bind_io(self, g: _Graph, bd: _Binding, b: int, t: int, shared: bool):
        # input_ids/position_ids/logits live in buffers of ours; a shared binding's logits are a view of the
        # engine's one large buffer (grown to the largest call seen), a small shape's are its own
        n = b * t * self.logits_size
        if shared:
            if self._logits.size < n:
                self._logits = np.empty(n, dtype=self._logits_dtype)
            bd.logits = self._logits[:n].reshape(b, t, self.logits_size)
        else:
            bd.logits = np.empty((b, t, self.logits_size), dtype=self._logits_dtype)
        bd.ids = np.empty((b, t), np.int64)
        bd.pos = np.empty((b, t), np.int64)
        bd.io.bind_input("input_ids", "cpu", 0, np.int64, [b, t], bd.ids.ctypes.data)
        bd.io.bind_input("position_ids", "cpu", 0, np.int64, [b, t], bd.pos.ctypes.data)
        bd.io.bind_output("logits", "cpu", 0, self._logits_dtype, [b, t, self.logits_size], bd.logits.ctypes.data)
        bd.extra = {}
        for name, size in self.extra_inputs.items():
            bd.extra[name] = np.zeros((b, t, size), dtype=self.dtype)
            bd.io.bind_input(name, "cpu", 0, self.dtype, [b, t, size], bd.extra[name].ctypes.data)
        if g.tree:
            bd.tree = chain_mask(b, t).copy()
            bd.causal = True
            bd.io.bind_input(TREE_MASK, "cpu", 0, np.bool_, [b, t, t], bd.tree.ctypes.data)
        if self.features_size:
            bd.features = np.empty((b, t, self.features_size), dtype=self._logits_dtype)
            bd.io.bind_output(HIDDEN_STATES, "cpu", 0, self._logits_dtype, list(bd.features.shape), bd.features.ctypes.data)
        bd.shape = (b, t)

