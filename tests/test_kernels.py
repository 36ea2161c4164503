"""Our own GGUF kernels (trtspec/kernels): every type kept exactly, every instruction-set path this CPU runs.

The float variant is held against a float64 product with gguf's own dequantization; the int8 variant, bit for
bit, against a numpy model of its rounding (below). Every path equals the portable C++ path bit for bit, and a
row's result is the same whatever else shares its call and however many threads run it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="pip install 'trtspec[gguf]'")

from trtspec import kernels  # noqa: E402
from trtspec.testing import gguf_blocks  # noqa: E402

ROWS = (1, 2, 5, 12, 17, 32)  # tiles: 12 is one of the widest (VNNI), 17 two, 32 three
PATHS = kernels.paths()


def int8_model(b: kernels.Blocks, x: np.ndarray) -> np.ndarray:
    """The int8 variant in numpy, step by step as csrc/gguf_linear.h specifies it: x [m, k] -> [m, n] float32."""
    m, k = x.shape
    n, g = b.shape[0], b.group
    groups = k // g
    blocks = x.reshape(m, k // 32, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)                       # [m, k/32]
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    a = np.rint(blocks * inv[..., None]).astype(np.int64).reshape(m, groups, g)
    sums = a.sum(-1)                                                    # [m, groups]
    codes = b.codes.astype(np.int64).reshape(n, groups, g)
    dots = np.einsum("mgi,ngi->mng", a, codes) - b.zero * sums[:, None, :]
    t = dots.astype(np.float32) * b.scales[None]
    if b.minimums is not None:
        t = t + b.minimums[None] * sums.astype(np.float32)[:, None, :]
    acc = np.zeros((m, n), np.float32)
    for j in range(groups):
        acc = acc + t[:, :, j] * d[:, None, j * g // 32]
    return acc


def _layer(type_name: str, n: int = 40, k: int = 512, seed: int = 0):
    raw = gguf_blocks(type_name, n, k, np.random.default_rng(seed))
    return raw, kernels.decode(type_name, raw, n, k)


def _x(m: int, k: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (m, k)).astype(np.float32)


@pytest.fixture
def path():
    """Restores the fastest path after a test that chose another."""
    yield
    kernels.use_path(PATHS[0])


# ---- the blocks and the layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", kernels.TYPES)
def test_decoded_blocks_dequantize_as_gguf_does_bit_for_bit(type_name):
    raw, b = _layer(type_name)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(b.shape)
    assert np.array_equal(kernels.dequantize(b), expected)


@pytest.mark.parametrize("half", [None, False])
@pytest.mark.parametrize("type_name", kernels.TYPES)
def test_layout_holds_every_code_scale_and_minimum(type_name, half):
    _, b = _layer(type_name, n=37)  # a padded last panel
    back = kernels.unpack(kernels.pack(b, half_scales=half))
    assert np.array_equal(back.codes, b.codes) and np.array_equal(back.scales, b.scales)
    assert (b.minimums is None) == (back.minimums is None)
    assert b.minimums is None or np.array_equal(back.minimums, b.minimums)


def test_a_k_quant_of_a_ragged_input_size_is_refused():
    with pytest.raises(ValueError, match="Q4_K tensor's input size must be a multiple of 256, got 288"):
        kernels.decode("Q4_K", np.zeros(144, np.uint8), 1, 288)


# ---- the op on every path ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel_path", PATHS)
@pytest.mark.parametrize("type_name", kernels.TYPES)
def test_float_activations_equal_the_float64_product_within_float32_rounding(type_name, kernel_path, path):
    _, b = _layer(type_name)
    layer = kernels.pack(b)
    w = kernels.dequantize(b).astype(np.float64)
    kernels.use_path(kernel_path)
    for m in ROWS:
        x = _x(m, layer.k)
        y = kernels.linear(torch.from_numpy(x), layer).numpy()
        bound = np.abs(x.astype(np.float64)) @ np.abs(w).T  # the size of the sum, whatever its cancellations
        assert np.all(np.abs(y - x.astype(np.float64) @ w.T) <= 1e-5 * bound), (type_name, m)


@pytest.mark.parametrize("kernel_path", PATHS)
@pytest.mark.parametrize("type_name", kernels.TYPES)
def test_int8_activations_equal_the_numpy_model_bit_for_bit(type_name, kernel_path, path):
    _, b = _layer(type_name)
    layer = kernels.pack(b)
    kernels.use_path(kernel_path)
    for m in ROWS:
        x = _x(m, layer.k)
        assert np.array_equal(kernels.linear(torch.from_numpy(x), layer, int8_activations=True).numpy(),
                              int8_model(b, x)), (type_name, m)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("type_name", kernels.TYPES)
def test_every_path_and_row_count_gives_each_row_the_same_bits(type_name, int8, path):
    """The portable path's result for 32 rows in one call; every path, each row alone and all 32 together."""
    _, b = _layer(type_name, n=48)
    layer = kernels.pack(b)
    x = torch.from_numpy(_x(32, layer.k))
    kernels.use_path("reference")
    expected = kernels.linear(x, layer, int8)
    for kernel_path in PATHS:
        kernels.use_path(kernel_path)
        assert torch.equal(kernels.linear(x, layer, int8), expected), kernel_path
        for r in (0, 7, 31):
            assert torch.equal(kernels.linear(x[r:r + 1], layer, int8)[0], expected[r]), (kernel_path, r)


LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("type_name", LEGACY)
def test_float16_scales_where_exact_and_the_same_bits_as_float32_ones(type_name, path):
    """The legacy types' d and m are the file's float16: packed at half the bytes, every path computes the same
    bits as from float32 scales. A K-quant's d * sc is not a float16 in general, and is refused as one."""
    _, b = _layer(type_name, n=48)
    half, full = kernels.pack(b), kernels.pack(b, half_scales=False)
    assert half.half_scales and not full.half_scales and half.data.size < full.data.size
    x = torch.from_numpy(_x(17, half.k))
    for kernel_path in PATHS:
        kernels.use_path(kernel_path)
        for int8 in (False, True):
            assert torch.equal(kernels.linear(x, half, int8), kernels.linear(x, full, int8)), (kernel_path, int8)
    _, q6 = _layer("Q6_K", n=48)
    assert not kernels.pack(q6).half_scales
    with pytest.raises(ValueError, match="not all float16"):
        kernels.pack(q6, half_scales=True)


@pytest.mark.parametrize("type_name", LEGACY)
def test_odd_shapes_input_not_a_multiple_of_256_output_not_of_the_panel(type_name):
    _, b = _layer(type_name, n=21, k=96)
    layer = kernels.pack(b)
    x = _x(3, 96)
    assert np.array_equal(kernels.linear(torch.from_numpy(x), layer, True).numpy(), int8_model(b, x))
    w = kernels.dequantize(b).astype(np.float64)
    np.testing.assert_allclose(kernels.linear(torch.from_numpy(x), layer).numpy(), x @ w.T, rtol=1e-5, atol=1e-5)


def test_one_and_two_threads_give_identical_results():
    _, b = _layer("Q4_K", n=160, k=1024)
    layer = kernels.pack(b)
    x = torch.from_numpy(_x(9, 1024))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [kernels.linear(x, layer, int8) for int8 in (False, True)]
        torch.set_num_threads(2)
        two = [kernels.linear(x, layer, int8) for int8 in (False, True)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_leading_dimensions_and_bad_arguments():
    _, b = _layer("Q4_1")
    layer = kernels.pack(b)
    x = torch.from_numpy(_x(6, 512)).reshape(2, 3, 512)
    y = kernels.linear(x, layer, True)
    assert y.shape == (2, 3, 40) and torch.equal(y.reshape(6, 40), kernels.linear(x.reshape(6, 512), layer, True))
    with pytest.raises(RuntimeError, match="last dimension must be 512"):
        kernels.linear(torch.zeros(2, 256), layer)
    with pytest.raises(RuntimeError, match="packed holds"):
        torch.ops.trtspec.gguf_linear(torch.zeros(1, 512), kernels.as_tensor(layer)[:-1], 40, 512, 4, 32, 0, True,
                                      layer.half_scales, False)
    with pytest.raises(RuntimeError, match="minimums has zero point 0, got 8"):  # the int8 kernels rely on it
        torch.ops.trtspec.gguf_linear(torch.zeros(1, 512), kernels.as_tensor(layer), 40, 512, 4, 32, 8, True,
                                      layer.half_scales, True)
    with pytest.raises(RuntimeError, match="no path named 'sse9'"):
        kernels.use_path("sse9")


def test_torch_export_traces_the_op_with_its_fake_shapes():
    _, b = _layer("Q6_K", n=40, k=512)
    layer = kernels.pack(b)

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("packed", kernels.as_tensor(layer))

        def forward(self, x):  # x [B, T, 512]
            return kernels.linear(x, layer, True, self.packed) * 2.0

    x = torch.from_numpy(_x(6, 512)).reshape(2, 3, 512)
    batch, tokens = torch.export.Dim("batch", max=8), torch.export.Dim("tokens", max=64)
    ep = torch.export.export(Linear(), (x,), dynamic_shapes={"x": {0: batch, 1: tokens}})
    assert any(n.target is torch.ops.trtspec.gguf_linear.default for n in ep.graph.nodes)
    x2 = torch.from_numpy(_x(20, 512, seed=3)).reshape(4, 5, 512)
    out = ep.module()(x2)
    assert out.shape == (4, 5, 40)
    assert torch.equal(out, 2.0 * torch.from_numpy(int8_model(b, x2.reshape(20, 512).numpy())).reshape(4, 5, 40))


# ---- attention, one query row at a time ----------------------------------------------------------------------

def _attention_case(d: int, t: int = 5, s: int = 70, seed: int = 0):
    """q [2, 6, t, d]; k, v: the first s slots of a larger cache, as the engines cut their caches; a causal mask at
    each row's own positions, the second row seeing fewer keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, t, d, generator=g)
    k = torch.randn(2, 3, s + 30, d, generator=g)[:, :, :s]
    v = torch.randn(2, 3, s + 30, d, generator=g)[:, :, :s]
    pos = torch.tensor([[s - t + i for i in range(t)], [10 + i for i in range(t)]])
    return q, k, v, torch.arange(s) <= pos[:, None, :, None]


def _reference_attention(q, k, v, mask, scale, softcap=None):
    """float64: softmax over the visible keys, key head h // (H / Hkv)."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("d", [64, 128, 24, 80])
def test_attention_equals_float64_softmax_and_each_row_its_own_bits_on_every_path(d, softcap, path):
    """Head sizes with their accumulators in registers (64, 80, 128) and not (24); grouped heads; a cut cache."""
    q, k, v, mask = _attention_case(d)
    np.testing.assert_allclose(kernels.attention(q, k, v, mask, 0.3, softcap).double(),
                               _reference_attention(q, k, v, mask, 0.3, softcap), rtol=1e-5, atol=2e-6)
    kernels.use_path("reference")
    expected = kernels.attention(q, k, v, mask, 0.3, softcap)
    for kernel_path in PATHS:
        kernels.use_path(kernel_path)
        assert torch.equal(kernels.attention(q, k, v, mask, 0.3, softcap), expected), kernel_path
        for t in (0, 4):  # a row alone: the bits it has among five
            alone = kernels.attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], 0.3, softcap)
            assert torch.equal(alone, expected[:, :, t:t + 1]), (kernel_path, t)


@pytest.mark.parametrize("d", [64, 80])
def test_attention_tiles_of_rows_with_different_spans_give_each_row_its_own_bits(d, path):
    """Rows sharing a key head go through tiles (a block of keys and values read once for the tile's rows): rows
    whose windows start and end in different 16-key blocks, one of a single key, one that sees nothing, each get
    the bits they get alone, on every path."""
    g = torch.Generator().manual_seed(7)
    lo = torch.tensor([0, 5, 40, 17, 100, 390, 0, 64, 63, 200, 3])
    hi = torch.tensor([399, 30, 41, 250, 100, 400, 1, 129, 300, 390, 398])
    T, keys = len(lo), torch.arange(400)
    q = torch.randn(1, 8, T, d, generator=g)  # 8 heads over 2 key heads: runs of 44 rows
    k, v = torch.randn(1, 2, 400, d, generator=g), torch.randn(1, 2, 400, d, generator=g)
    mask = ((keys >= lo[:, None]) & (keys < hi[:, None]))[None, None]
    kernels.use_path("reference")
    expected = kernels.attention(q, k, v, mask, 0.125)
    np.testing.assert_allclose(expected.double(), _reference_attention(q, k, v, mask, 0.125), rtol=1e-5, atol=2e-6)
    assert torch.isnan(expected[:, :, 4]).all() and not torch.isnan(expected[:, :, [3, 5]]).any()
    bits = lambda x: x.contiguous().view(torch.int32)  # noqa: E731 (NaN's bits too)
    for kernel_path in PATHS:
        kernels.use_path(kernel_path)
        assert torch.equal(bits(kernels.attention(q, k, v, mask, 0.125)), bits(expected)), kernel_path
        for t in range(T):
            alone = kernels.attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], 0.125)
            assert torch.equal(bits(alone), bits(expected[:, :, t:t + 1])), (kernel_path, t)
        one_head = kernels.attention(q[:, 5:6], k[:, 1:], v[:, 1:], mask, 0.125)
        assert torch.equal(bits(one_head), bits(expected[:, 5:6])), kernel_path


def test_attention_long_context_threads_and_a_row_that_sees_nothing():
    q, k, v, mask = _attention_case(64, t=3, s=1500)
    with torch.no_grad():
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.attention(q, k, v, mask, 0.125)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(kernels.attention(q, k, v, mask, 0.125), one)
    np.testing.assert_allclose(one.double(), _reference_attention(q, k, v, mask, 0.125), rtol=1e-5, atol=2e-6)
    blind = mask.clone()
    blind[0, :, 1] = False
    out = kernels.attention(q, k, v, blind, 0.125)
    assert torch.isnan(out[0, :, 1]).all() and not torch.isnan(out[0, :, [0, 2]]).any()
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        kernels.attention(q[:, :5], k, v, mask, 0.125)


@pytest.mark.parametrize("d", [64, 24])
def test_attention_over_a_whole_cache_equals_the_cache_cut_to_the_rows_visible_span(d, path):
    """The engines pass the whole cache with its unwritten slots masked: a row's visible keys are a span in it (here
    a sliding window, 37..299 of 2048, with a hole). Its bits are those of the cache cut to the span's 16-key blocks."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 4, d, generator=g)
    k, v = torch.randn(1, 3, 2048, d, generator=g), torch.randn(1, 3, 2048, d, generator=g)
    pos = torch.arange(296, 300)[None, None, :, None]
    keys = torch.arange(2048)
    mask = (keys <= pos) & (keys > pos - 263) & (keys != 100)
    kernels.use_path("reference")
    expected = kernels.attention(q, k, v, mask, 0.125)
    np.testing.assert_allclose(expected.double(), _reference_attention(q, k, v, mask, 0.125), rtol=1e-5, atol=2e-6)
    for kernel_path in PATHS:
        kernels.use_path(kernel_path)
        assert torch.equal(kernels.attention(q, k, v, mask, 0.125), expected), kernel_path
        cut = kernels.attention(q, k[:, :, 32:304], v[:, :, 32:304], mask[..., 32:304], 0.125)
        assert torch.equal(cut, expected), kernel_path
        # the compiled step's call: the whole caches, the mask over their first (live) slots only
        live = kernels.attention_rows_live(q, k, v, mask[..., :304].expand(1, 1, 4, 304).contiguous(), 0.125)
        assert torch.equal(live, expected), kernel_path
        # and as the int8 step calls it: its rows written as [B, T, H * D], the output projection's input
        tokens = kernels.attention_rows_tokens(q, k, v, mask[..., :304].expand(1, 1, 4, 304).contiguous(), 0.125)
        assert tokens.shape == (1, 4, 6 * d) and torch.equal(tokens, expected.transpose(1, 2).flatten(2)), kernel_path
    assert torch.equal(kernels.torch_path.attention_rows(q, k, v, mask[..., :304].expand(1, 1, 4, 304), 0.125, 0.0),
                       kernels.torch_path.attention_rows(q, k, v, mask.expand(1, 1, 4, 2048), 0.125, 0.0))
    assert torch.equal(
        kernels.torch_path.attention_rows_tokens(q, k, v, mask[..., :304].expand(1, 1, 4, 304), 0.125, 0.0),
        kernels.torch_path.attention_rows(q, k, v, mask.expand(1, 1, 4, 2048), 0.125, 0.0).transpose(1, 2).flatten(2))
    with pytest.raises(RuntimeError, match="S at least the mask's"):
        kernels.attention_rows_live(q, k[:, :, :300], v[:, :, :300], mask[..., :304].expand(1, 1, 4, 304), 0.125)


def test_attention_traces_with_torch_export():
    q, k, v, mask = _attention_case(64)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            full = mask.expand(q.shape[0], 1, q.shape[2], k.shape[2])
            return kernels.attention(q, k, v, mask, 0.125) + 1.0, kernels.attention_rows_tokens(q, k, v, full, 0.125)

    tokens = torch.export.Dim("tokens", min=2, max=64)
    ep = torch.export.export(Attention(), (q, k, v, mask),
                             dynamic_shapes=({2: tokens}, None, None, {2: tokens}))
    targets = {n.target for n in ep.graph.nodes}
    assert {torch.ops.trtspec.attention_rows.default, torch.ops.trtspec.attention_rows_tokens.default} <= targets
    q2, _, _, mask2 = _attention_case(64, t=9, seed=4)
    got, flat = ep.module()(q2, k, v, mask2)
    rows = kernels.attention(q2, k, v, mask2, 0.125)
    assert torch.equal(got, rows + 1.0) and torch.equal(flat, rows.transpose(1, 2).flatten(2))


# ---- the step's small ops: RMSNorm, a layer's q/k/v RoPE, SiLU's product ---------------------------------------------------------

def _hf_rms_norm(x, weight, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(x)


@pytest.mark.parametrize("n", [576, 60, 7])
def test_rms_norm_equals_hf_within_float32_rounding_and_each_row_its_own_bits(n):
    """HF's LlamaRMSNorm within float32 rounding (the mean's sum is ordered differently), over rows of a size with a
    tail after the 8 partial sums; a row computed alone, or among 40 (split between threads), has the same bits;
    the pure-torch path (no compiler) is HF's own arithmetic."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 20, n, generator=g) * 3, torch.randn(n, generator=g)
    out = kernels.rms_norm(x, weight, 1e-5)
    expected = _hf_rms_norm(x, weight, 1e-5)
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-6)
    assert not torch.equal(out, x)
    for b, t in ((0, 0), (1, 13)):
        assert torch.equal(kernels.rms_norm(x[b, t:t + 1], weight, 1e-5), out[b, t:t + 1])
    assert torch.equal(kernels.torch_path.rms_norm(x, weight, 1e-5), expected)
    with pytest.raises(RuntimeError, match="must agree"):
        kernels.rms_norm(x, weight[:-1], 1e-5)


def _hf_rope(x, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(x, x, cos, sin)[0]  # x [B, H, T, D], cos [B, T, D]


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (2, 1, 128)])
def test_rope_qkv_splits_and_rotates_q_and_k_exactly_as_hf(heads, kv_heads, d):
    """q rotated in attention's layout [B, H, T, D], k rotated and v as they are in the cache writes' [B, T, Hkv, D];
    HF's apply_rotary_pos_emb to the bit (the same products and sums); a row alone has its bits among 6 x 3."""
    g = torch.Generator().manual_seed(1)
    b, t = 3, 6
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=g)
    angles = torch.randn(b, t, d // 2, generator=g) * 4
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = qkv.unflatten(-1, (heads + 2 * kv_heads, d)).split([heads, kv_heads, kv_heads], dim=2)
    for impl in (kernels.rope_qkv, kernels.torch_path.rope_qkv):
        rq, rk, rv = impl(qkv, cos, sin, heads, kv_heads)
        assert rq.shape == (b, heads, t, d) and rk.shape == rv.shape == (b, t, kv_heads, d)
        assert torch.equal(rq, _hf_rope(q.transpose(1, 2), cos, sin)), impl
        assert torch.equal(rk, _hf_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)), impl
        assert torch.equal(rv, v), impl
    alone = kernels.rope_qkv(qkv[2:, 4:5], cos[2:, 4:5], sin[2:, 4:5], heads, kv_heads)
    assert torch.equal(alone[0], rq[2:, :, 4:5]) and torch.equal(alone[1], rk[2:, 4:5])
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv_heads"):
        kernels.rope_qkv(qkv, cos, sin, heads + 1, kv_heads)


def test_silu_mul_equals_hfs_silu_product_within_float32_rounding_the_same_bits_on_every_width():
    """silu(gate) * up of a fused [..., 2N] output: within 2 ulps of HF's module (and 4e-7 of float64), over gates
    from -200 to 100 (exp overflowing, subnormal results, 0, a subnormal gate); each row alone has its bits among 3 x 7; every
    vector width this CPU runs gives the same bits; the pure-torch path is HF's arithmetic."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 2 * 200, generator=g) * 6
    x[0, 0, :10] = torch.tensor([-200.0, -100.0, -89.5, -87.5, -30.0, 0.0, 1e-40, 30.0, 88.5, 100.0])
    gate, up = x.chunk(2, dim=-1)
    out = kernels.silu_mul(x)
    hf = ACT2FN["silu"](gate) * up
    assert out.shape == (3, 7, 200)
    np.testing.assert_allclose(out, hf, rtol=2.5e-7, atol=1e-44)
    exact = gate.double() / (1 + torch.exp(-gate.double())) * up.double()
    finite = gate > -88.7  # (below, exp(-gate) overflows float32: the product is 0, as HF's is)
    assert ((out.double() - exact).abs() <= 4e-7 * exact.abs() + 1e-44)[finite].all()
    assert (out[~finite] == 0).all() and (~finite).sum() == 3
    assert torch.equal(kernels.silu_mul(x[2:, 5:6]), out[2:, 5:6])
    widths = torch.ops.trtspec.silu_mul_widths(x)
    assert len(widths) >= 2 and all(torch.equal(w, out) for w in widths)
    # bit for bit beyond the finite values, rows of 13 (a vector loop and its tail): NaN, infinities, -0
    odd = torch.randn(2, 2 * 13, generator=g) * 50
    odd[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 88.72, -88.73])
    odd[1, 13:16] = torch.tensor([float("nan"), float("inf"), -0.0])
    bits = [w.view(torch.int32) for w in torch.ops.trtspec.silu_mul_widths(odd)]
    assert all(torch.equal(b, bits[-1]) for b in bits) and torch.isnan(bits[-1].view(torch.float32)[0, 0])
    assert torch.equal(kernels.torch_path.silu_mul(x), hf)
    with pytest.raises(RuntimeError, match="even last dimension"):
        kernels.silu_mul(x[..., :-1])


def test_the_step_ops_trace_with_torch_export():
    class Block(torch.nn.Module):
        def forward(self, x, cos, sin, w):
            q, k, v = kernels.rope_qkv(x, cos, sin, 2, 1)
            return kernels.rms_norm(q, w, 1e-6), kernels.silu_mul(k + v)

    x, cos, sin, w = torch.randn(2, 3, 32), torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8)
    tokens = torch.export.Dim("tokens", min=1, max=64)
    ep = torch.export.export(Block(), (x, cos, sin, w), dynamic_shapes=({1: tokens}, {1: tokens}, {1: tokens}, None))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"trtspec.rope_qkv.default", "trtspec.rms_norm.default", "trtspec.silu_mul.default"} <= ops
    x5, c5, s5 = torch.randn(2, 5, 32), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    for got, want in zip(ep.module()(x5, c5, s5, w), Block()(x5, c5, s5, w)):
        assert torch.equal(got, want)


def test_without_a_compiler_the_op_falls_back_to_torch_with_a_clear_message(tmp_path):
    """TRTSPEC_CXX pointing at no compiler and an empty cache: a warning that says so and how to fix it, and the
    pure-torch op, whose int8 variant is the kernels' bit for bit."""
    script = """
import warnings, numpy as np, torch
from trtspec import kernels
from trtspec.testing import gguf_blocks
raw = gguf_blocks("Q5_K", 40, 512, np.random.default_rng(0))
b = kernels.decode("Q5_K", raw, 40, 512)
layer = kernels.pack(b)
x = np.random.default_rng(1).normal(0, 1, (5, 512)).astype(np.float32)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = kernels.linear(torch.from_numpy(x), layer, True).numpy()
    f = kernels.linear(torch.from_numpy(x), layer).numpy()
    q, k = torch.randn(1, 4, 3, 64), torch.randn(1, 2, 9, 64)
    mask = torch.arange(9) <= torch.tensor([[6, 7, 8]])[:, None, :, None]
    a = kernels.attention(q, k, k, mask, 0.125)
    rep = k.repeat_interleave(2, 1)
    ref = torch.softmax((q @ rep.transpose(-1, -2) * 0.125).masked_fill(~mask, float("-inf")), -1) @ rep
print("ATTENTION", float((a - ref).abs().max()))
print("WARN", " ".join(str(w.message) for w in caught))
print("STATUS", kernels.status()["backend"], kernels.paths())
np.save(__import__("sys").argv[1], np.stack([y, f]))
"""
    env = {**os.environ, "TRTSPEC_CXX": str(tmp_path / "no-such-compiler"), "TRTSPEC_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "y.npy")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "could not be built (no C++ compiler at" in done.stdout and "TRTSPEC_CXX" in done.stdout
    assert "STATUS torch ['torch']" in done.stdout
    assert float(done.stdout.split("ATTENTION ")[1].split()[0]) < 1e-5
    y, f = np.load(tmp_path / "y.npy")
    _, b = _layer("Q5_K")
    x = _x(5, 512)
    assert np.array_equal(y, int8_model(b, x))
    w = kernels.dequantize(b).astype(np.float64)
    np.testing.assert_allclose(f, x @ w.T, rtol=1e-5, atol=1e-4)


def test_trtspec_kernel_path_chooses_the_path_and_refuses_one_this_cpu_lacks(tmp_path):
    """$TRTSPEC_KERNEL_PATH picks the path at load (the slowest vector path here gives the fastest's bits), and a
    path the CPU cannot run is refused with the paths it can."""
    script = """
import numpy as np, torch
from trtspec import kernels
from trtspec.testing import gguf_blocks
b = kernels.decode("Q4_1", gguf_blocks("Q4_1", 40, 512, np.random.default_rng(0)), 40, 512)
x = torch.from_numpy(np.random.default_rng(1).normal(0, 1, (5, 512)).astype(np.float32))
np.save(__import__("sys").argv[1], np.stack([kernels.linear(x, kernels.pack(b), i).numpy() for i in (True, False)]))
print("PATH", kernels.status()["path"])
"""
    chosen = PATHS[-2] if len(PATHS) > 1 else PATHS[0]
    out = str(tmp_path / "y.npy")
    done = subprocess.run([sys.executable, "-c", script, out], env={**os.environ, "TRTSPEC_KERNEL_PATH": chosen},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"PATH {chosen}" in done.stdout
    _, b = _layer("Q4_1")
    x = torch.from_numpy(_x(5, 512))
    y = np.load(out)
    assert np.array_equal(y[0], kernels.linear(x, kernels.pack(b), True).numpy())
    assert np.array_equal(y[1], kernels.linear(x, kernels.pack(b), False).numpy())
    done = subprocess.run([sys.executable, "-c", script, out], env={**os.environ, "TRTSPEC_KERNEL_PATH": "avx1024"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "TRTSPEC_KERNEL_PATH='avx1024'" in done.stderr and f"{PATHS}" in done.stderr
