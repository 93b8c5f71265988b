"""The inspector's run comparison: curves overlaid by run, smoothed as TensorBoard's slider smooths (by hand)."""

from __future__ import annotations

import pandas as pd
import pytest

from loopline.ui.data import overlaid


def test_curves_are_overlaid_by_run_in_step_order_and_smoothed_by_an_exponential_average():
    a = pd.DataFrame({"step": [2, 1, 3], "reward_mean": [1.0, 0.0, 1.0]})  # (as the pivot may order them)
    b = pd.DataFrame({"step": [1, 2], "reward_mean": [0.5, None]})  # a step without the metric: left out
    frame = overlaid({"a": a, "b": b, "empty": pd.DataFrame()}, "step", "reward_mean", smoothing=0.5)
    assert frame["run"].tolist() == ["a", "a", "a", "b"] and frame["step"].tolist() == [1, 2, 3, 1]
    # s_1 = x_1; s_t = 0.5 s_(t-1) + 0.5 x_t
    assert frame["reward_mean"].tolist() == pytest.approx([0.0, 0.5, 0.75, 0.5])
    raw = overlaid({"a": a}, "step", "reward_mean")
    assert raw["reward_mean"].tolist() == [0.0, 1.0, 1.0]
    assert overlaid({"a": a}, "step", "entropy").empty  # a metric the run never recorded: nothing drawn
