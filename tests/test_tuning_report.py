"""The zoomed panel of the tuning curves is scaled to the late rounds of the curves and the reference lines."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.tuning.report import zoom_limits


def test_zoom_ignores_early_rounds_and_holds_the_levels():
    curve = pd.Series({10: 0.30, 40: 0.80, 50: 0.91, 100: 0.92, 300: 0.93})
    low, high = zoom_limits([curve], levels=[0.914, 0.933], from_round=50, pad=0.1)
    assert 0.89 < low < 0.91 and 0.933 < high < 0.94  # 0.30 and 0.80 (rounds 10, 40) do not stretch the axis


def test_a_curve_without_late_rounds_contributes_its_last_value():
    short = pd.Series({10: 0.2, 20: 0.5})
    low, high = zoom_limits([short], levels=[0.6], from_round=50, pad=0.0)
    assert low == pytest.approx(0.5 - 0.005) and high == pytest.approx(0.6 + 0.005)


def test_nothing_to_fit_is_an_error():
    with pytest.raises(ValueError, match="nothing to fit|no curve values"):
        zoom_limits([], levels=[])


def test_a_curve_below_the_floor_does_not_set_the_scale():
    close = pd.Series({50: 0.915, 100: 0.925})
    far = pd.Series({50: 0.84, 100: 0.86})
    low, _ = zoom_limits([close, far], levels=[0.914, 0.933], floor=0.895, pad=0.0)
    assert low == pytest.approx(0.914 - 0.005)
