"""The membership-margin step's root search (fedrec_flwr.unlearning.margin.bracket_root) at its edge cases, by hand: a
margin that is already 0 (or below) at the trained model asks for no step after the first query round."""

from __future__ import annotations

import pytest

from fedrec_flwr.unlearning.margin import MARGIN_LADDER, bracket_root


@pytest.mark.parametrize("margin", [lambda a: -a, lambda a: 0.0 * a, lambda a: -1.0 - a])
def test_a_margin_not_above_zero_at_the_start_takes_no_step(margin):
    asked = []

    def evaluate(steps):
        asked.append(list(steps))
        return [margin(a) for a in steps]

    result = bracket_root(evaluate)
    assert result.step == 0.0 and result.termination == "nonpositive-at-zero" and result.rounds == 1
    assert asked == [sorted(MARGIN_LADDER)]  # one query round, the ladder


def test_an_affine_margin_crossing_zero_between_ladder_steps_is_solved_exactly():
    # M(a) = 3 - 2a: the root 1.5 lies between the ladder's 1 and 2; regula falsi on an affine M is exact
    result = bracket_root(lambda steps: [3.0 - 2.0 * a for a in steps], rounds=2)
    assert result.termination == "root" and result.step == pytest.approx(1.5, rel=1e-12)
