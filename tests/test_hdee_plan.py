"""HDEE plans: equal FLOPs across the three settings, difficulty order, errors."""

import pytest

from lowcomm_jax.hdee import plan as plan_lib

CHAINS = {"hard": ("foldoc", "python_docs", "octave_manual"),
          "moderate": ("stdlib", "wordnet", "austen"),
          "easy": ("gcide", "man_pages_dev", "bible_kjv")}
TOKENS_PER_STEP = 16 * 256


def _linear_ffn_flops(d_ff_medium=384):
  """FLOPs per token of a model whose only size difference is the FFN width."""
  widths = plan_lib.ffn_widths(d_ff_medium)
  return lambda size: 6.0 * (400_000 + 3 * 128 * 6 * widths[size])


def test_ffn_widths_are_the_paper_ratios():
  assert plan_lib.ffn_widths(3072) == {"S": 2304, "M": 3072, "L": 3840}
  assert plan_lib.ffn_widths(384) == {"S": 288, "M": 384, "L": 480}


def test_paper_steps_and_equal_budgets():
  fpt = _linear_ffn_flops()
  budget = plan_lib.budget_for_steps(400, fpt, TOKENS_PER_STEP, CHAINS)
  plans = plan_lib.make_plans(budget, fpt, TOKENS_PER_STEP, CHAINS)
  steps = {s: {c.chain: c.steps_per_domain for c in p.chains} for s, p in plans.items()}
  assert steps["homogeneous"] == {c: (400,) * 3 for c in CHAINS}
  assert steps["heterogeneous_steps"] == {"hard": (500,) * 3, "moderate": (400,) * 3,
                                          "easy": (300,) * 3}
  assert steps["heterogeneous_sizes"] == {c: (400,) * 3 for c in CHAINS}
  sizes = {c.chain: c.size for c in plans["heterogeneous_sizes"].chains}
  assert sizes == {"hard": "L", "moderate": "M", "easy": "S"}
  for plan in plans.values():
    assert plan.flops == pytest.approx(budget, rel=1e-12)
    assert plan.chain("hard").domains == CHAINS["hard"]


@pytest.mark.parametrize("setting", ["heterogeneous_steps", "heterogeneous_sizes"])
def test_heterogeneous_plans_respect_difficulty_order(setting):
  fpt = _linear_ffn_flops()
  plan = plan_lib.make_plan(setting, 3.3e14, fpt, TOKENS_PER_STEP, CHAINS)
  flops = plan.flops_by_chain()
  assert flops["hard"] > flops["moderate"] > flops["easy"]
  # Harder chains get more of the budget, the hard and easy chains symmetrically.
  assert flops["hard"] - flops["moderate"] == pytest.approx(flops["moderate"] - flops["easy"])


def test_budget_is_the_largest_fitting_multiple_of_four_steps():
  fpt = _linear_ffn_flops()
  per_step = 9 * TOKENS_PER_STEP * fpt("M")
  plans = plan_lib.make_plans(per_step * 403.9, fpt, TOKENS_PER_STEP, CHAINS)
  assert plans["homogeneous"].chain("easy").steps_per_domain == (400,) * 3
  assert plans["heterogeneous_steps"].chain("easy").steps_per_domain == (300,) * 3
  for plan in plans.values():
    assert plan.flops <= plan.budget_flops


def test_lead_model_sizes_are_equal_within_two_percent():
  models = pytest.importorskip("lowcomm_jax.models")
  widths = plan_lib.ffn_widths(models.get_model_config("small").d_ff)
  configs = {size: models.get_model_config("small", d_ff=w) for size, w in widths.items()}
  fpt = lambda size: models.flops_per_token(configs[size], 256)
  plans = plan_lib.make_plans(1e15, fpt, TOKENS_PER_STEP, CHAINS)
  reference = plans["homogeneous"].flops
  for plan in plans.values():
    assert abs(plan.flops / reference - 1) < 0.02


def test_budget_too_small_for_the_smallest_expert():
  fpt = _linear_ffn_flops()
  minimum = 4 * 9 * TOKENS_PER_STEP * fpt("M")
  with pytest.raises(ValueError, match=r"budget_flops=.* is too small"):
    plan_lib.make_plan("homogeneous", minimum * 0.99, fpt, TOKENS_PER_STEP, CHAINS)
  assert plan_lib.make_plan("homogeneous", minimum, fpt, TOKENS_PER_STEP,
                            CHAINS).chain("hard").steps_per_domain == (4, 4, 4)


def test_bad_input_errors():
  fpt = _linear_ffn_flops()
  with pytest.raises(ValueError, match=r"unknown HDEE domain 'math'"):
    plan_lib.make_plan("homogeneous", 1e16, fpt, TOKENS_PER_STEP,
                       {**CHAINS, "hard": ("math", "physics", "cs")})
  with pytest.raises(ValueError, match=r"unknown HDEE setting 'mixed'; allowed: homogeneous"):
    plan_lib.make_plan("mixed", 1e16, fpt, TOKENS_PER_STEP, CHAINS)
  with pytest.raises(ValueError, match=r"exactly the keys \['hard', 'moderate', 'easy'\]"):
    plan_lib.make_plan("homogeneous", 1e16, fpt, TOKENS_PER_STEP, {"hard": ("stdlib",)})
  # S and L whose FLOPs do not average to M's break the equal-compute promise.
  lopsided = {"S": 1.0e6, "M": 1.0e6, "L": 1.5e6}.__getitem__
  with pytest.raises(ValueError, match=r"away from the homogeneous"):
    plan_lib.make_plan("heterogeneous_sizes", 1e16, lopsided, TOKENS_PER_STEP, CHAINS)
  assert plan_lib.make_plan("M_He-I_Ho", 1e16, fpt, TOKENS_PER_STEP, CHAINS).setting == (
      "heterogeneous_sizes")


def test_format_plans_reports_flops_per_chain_and_ratio():
  fpt = _linear_ffn_flops()
  budget = plan_lib.budget_for_steps(400, fpt, TOKENS_PER_STEP, CHAINS)
  table = plan_lib.format_plans(plan_lib.make_plans(budget, fpt, TOKENS_PER_STEP, CHAINS))
  rows = table.splitlines()[2:]
  assert len(rows) == 3
  assert rows[1].startswith("| heterogeneous_steps (M_Ho-I_He) | M, 500, ")
  assert rows[2].startswith("| heterogeneous_sizes (M_He-I_Ho) | L, 400, ")
  assert all(row.endswith("| 1.0000 |") for row in rows)
