"""trtspec.quantization.numerics against a numpy reference: INT8/INT4/FP8 rounding, SmoothQuant, AWQ, GPTQ."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from quant_reference import ref_fp8, ref_int4, ref_int8
from trtspec.quantization import numerics, passes
from trtspec.quantization.report import QuantizationReport


# -- numerics ------------------------------------------------------------------------------------------


def test_int8_int4_fp8_numerics_match_the_numpy_reference():
    w = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    w[3, 2] = 9.0  # an outlier in one channel
    np.testing.assert_array_equal(numerics.fake_quantize(w, "int8"), ref_int8(w))
    np.testing.assert_array_equal(numerics.fake_quantize(w, "int4", 32), ref_int4(w, 32))
    np.testing.assert_allclose(numerics.fake_quantize(w, "fp8"), ref_fp8(w), rtol=1e-6, atol=0)
    q, scale = numerics.int4_blocked(w, 16)
    assert q.dtype == ml_dtypes.int4 and scale.shape == (4, 6)
    assert q.astype(np.int8).min() >= -8 and q.astype(np.int8).max() <= 7


def test_smoothquant_factors_follow_the_formula():
    rng = np.random.default_rng(1)
    x_absmax = rng.random(8).astype(np.float32) * 10
    w1, w2 = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    w_absmax = np.maximum(np.abs(w1).max(axis=1), np.abs(w2).max(axis=1))
    expected = x_absmax**0.5 / w_absmax**0.5
    np.testing.assert_allclose(numerics.smoothquant_factors(x_absmax, [w1, w2], 0.5), expected, rtol=1e-5)


def test_awq_search_picks_the_grid_point_with_the_least_output_error():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    x[:, 5] *= 20  # a salient input channel: AWQ should scale it up
    w = rng.standard_normal((32, 16)).astype(np.float32)
    mean_abs = np.abs(x).mean(axis=0)
    s, alpha, loss, rtn_loss = numerics.awq_search(x, mean_abs, [w], 16)
    losses = []
    for a in np.arange(20) / 20:
        t = mean_abs**a
        t = t / np.sqrt(t.max() * t.min())
        losses.append(np.square((x / t) @ ref_int4(w * t[:, None], 16) - x @ w).sum())
    assert alpha == pytest.approx(np.argmin(losses) / 20)
    assert loss == pytest.approx(min(losses), rel=1e-3) and rtn_loss == pytest.approx(losses[0], rel=1e-3)
    assert alpha > 0 and loss < rtn_loss


def test_awq_search_in_bfloat16_picks_a_scale_within_one_percent_of_the_float32_best():
    """Where bfloat16 matmuls are fast the search's error products run in bfloat16: the alpha it picks must be as
    good as float32's, judged in float32."""
    import torch

    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 64)).astype(np.float32)
    x[:, [3, 17]] *= 25
    w = rng.standard_normal((64, 96)).astype(np.float32)
    mean_abs = np.abs(x).mean(axis=0)
    exact = numerics.awq_search(x, mean_abs, [w], 32)
    fast = numerics.awq_search(x, mean_abs, [w], 32, matmul_dtype=torch.bfloat16)
    loss_of = {}
    for a in np.arange(20) / 20:
        t = mean_abs**a
        t = t / np.sqrt(t.max() * t.min())
        loss_of[round(a, 2)] = np.square((x / t) @ ref_int4(w * t[:, None], 32) - x @ w).sum()
    assert exact[1] > 0 and loss_of[round(fast[1], 2)] <= 1.01 * min(loss_of.values())
    assert fast[3] == pytest.approx(exact[3], rel=1e-2)  # round-to-nearest's loss, in both


def test_awq_clip_search_picks_each_blocks_best_range():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((48, 32)).astype(np.float32)
    w = rng.standard_normal((32, 5)).astype(np.float32)
    w[0, 0] = 8.0  # one outlier: clipping its block should pay
    clip, loss, unclipped = numerics.awq_clip_search(numerics.block_gram(x, 16), w, 16)
    ratios = [1.0 - 0.05 * i for i in range(10)]
    for b in range(2):
        rows = slice(16 * b, 16 * b + 16)
        for n in range(5):
            errors = []
            for r in ratios:
                col = w[rows, n]
                s = np.float32(np.abs(col).max() * np.float32(r)) / np.float32(7)
                q = np.array([max(-8, min(7, round(float(v / s)))) for v in col], np.float32) * s
                errors.append(np.square(x[:, rows] @ (col - q)).sum())
            assert clip[b, n] == pytest.approx(ratios[int(np.argmin(errors))])
    assert clip[0, 0] < 1.0 and loss < unclipped


# -- GPTQ on the tiny model's calibration inputs -------------------------------------------------------


def test_gptq_reconstruction_error_is_below_round_to_nearest(exported):
    """On the tiny model's own calibration inputs X: ||X W - X Q|| of GPTQ < RTN's for every MatMul."""
    import onnx_ir as ir
    from transformers import AutoTokenizer

    from trtspec.quantization import calibrate

    src = exported("llama-gqa-rope3")
    manifest = json.loads((src / "manifest.json").read_text())
    model = ir.load(src / "model.onnx")
    linears = passes.find_linears(model, QuantizationReport("int4-gptq"), include_lm_head=True)
    names = list(dict.fromkeys(lin.activation.name for lin in linears))
    texts, _ = calibrate.load_texts(None)
    windows = calibrate.token_windows(texts, AutoTokenizer.from_pretrained(src / "tokenizer"), 8, 64)
    stats = calibrate.collect(src / "model.onnx", manifest["model"], names, windows, hessian=True)
    for lin in linears:
        w, xtx = lin.weight_array(), stats[lin.activation.name].xtx.double().numpy()

        def error(deq):
            d = (deq - w).astype(np.float64)
            return float(np.sqrt(np.trace(d.T @ xtx @ d)))  # ||X (W - Q)||_F over every calibration token

        rtn = error(numerics.fake_quantize(w, "int4", 32))
        for act_order in (False, True):
            gptq = error(numerics.dequantize(*numerics.gptq(w, xtx, 32, act_order=act_order), 32))
            assert gptq < rtn, (lin.name, act_order, gptq, rtn)
