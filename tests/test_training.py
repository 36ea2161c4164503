"""The training helpers behind `trtspec distill` and benchmarks/train_pair.py."""

from __future__ import annotations

import numpy as np

from trtspec.training import TrainConfig, lr_at, random_windows, repeated_line_mask


def test_repeated_line_mask_marks_the_tokens_of_generated_lines_that_repeat_an_earlier_one():
    prompt = ["def f(x):", "\n    ", "y = 1"]  # the prompt's own lines never count
    generated = ["\n    ", "x", " = ", "x", "\n    ", "y = 1", "\n    ", "x", " = ", "x", "\n    ", "ret", "urn",
                 "\n    ", "x", " = ", "x", "\n"]
    mask = repeated_line_mask(prompt + generated, len(prompt))
    marked = [i - len(prompt) for i in np.flatnonzero(mask)]
    # "x = x" is generated three times: the 2nd and 3rd copies' tokens, not the newline-indent token that starts
    # them, but a bare newline that ends one (index 17); "y = 1" repeats a prompt line only; "return" is new
    assert marked == [7, 8, 9, 14, 15, 16, 17]
    # an unfinished last line is not judged, and nothing before start is ever marked
    assert not repeated_line_mask(["a", "\n", "a"], 0).any()
    assert repeated_line_mask(["a", "\n", "a", "\n"], 0).tolist() == [False, False, True, True]
    assert not repeated_line_mask(["a", "\n", "a", "\n"], 4).any()


def test_batches_are_a_function_of_seed_and_step_and_the_schedule_warms_up_then_decays():
    data = np.arange(1000, dtype=np.uint16)
    a, b = random_windows(data, 4, 16, 0, 7), random_windows(data, 4, 16, 0, 7)
    assert np.array_equal(a, b) and a.shape == (4, 17)
    assert np.array_equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows of the stream
    assert not np.array_equal(a, random_windows(data, 4, 16, 0, 8))
    cfg = TrainConfig(steps=150, lr=1e-3)
    rates = [lr_at(i, 150, cfg) for i in range(150)]
    assert rates[0] < rates[9] == max(rates) and abs(rates[-1] - 1e-4) < 2e-5
