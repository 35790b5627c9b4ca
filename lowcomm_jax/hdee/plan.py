"""HDEE compute plans: model size and steps per expert chain at equal total FLOPs.

The paper (docs/algorithms.md §4.1) compares three ensembles of three expert chains, each
chain training on three domains in turn, at the same compute:

| setting | paper name | sizes (hard/moderate/easy) | steps per domain (hard/moderate/easy) |
|---|---|---|---|
| homogeneous | ``M_Ho-I_Ho`` | M / M / M | b / b / b |
| heterogeneous_steps | ``M_Ho-I_He`` | M / M / M | 1.25b / b / 0.75b (500/400/300 for b=400) |
| heterogeneous_sizes | ``M_He-I_Ho`` | L / M / S | b / b / b |

Equal compute holds because the step ratios average to 1 and because the S and
L models differ from M only in their feed-forward width, 0.75x and 1.25x of
M's (2304/3072/3840 in the paper, see `ffn_widths`): the FLOPs per token are
linear in that width, so FLOPs(S) + FLOPs(L) = 2 FLOPs(M). `make_plan` checks
the equality on the FLOPs the caller's model formula gives and refuses a plan
whose total differs from the homogeneous one by more than `tolerance`.

The plan knows nothing of the model code: the caller passes
``flops_per_token(size_name) -> float`` for ``"S"``, ``"M"`` and ``"L"`` (for
instance `lowcomm_jax.models.flops_per_token` of three configs that differ in
``d_ff``) and the tokens per optimizer step.

Example::

  from lowcomm_jax import models
  from lowcomm_jax.hdee import domains, plan

  widths = plan.ffn_widths(384)                      # {'S': 288, 'M': 384, 'L': 480}
  configs = {s: models.get_model_config("small", d_ff=w) for s, w in widths.items()}
  fpt = lambda size: models.flops_per_token(configs[size], 256)
  budget = plan.budget_for_steps(400, fpt, 16 * 256, domains.REFERENCE_CHAINS)
  plans = plan.make_plans(budget, fpt, 16 * 256, domains.REFERENCE_CHAINS)
  print(plan.format_plans(plans))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from lowcomm_jax.data import domains as domains_lib
from lowcomm_jax.hdee import domains as chains_lib

SIZE_NAMES = ("S", "M", "L")
# Setting key -> the paper's name for it.
SETTINGS = {
    "homogeneous": "M_Ho-I_Ho",
    "heterogeneous_steps": "M_Ho-I_He",
    "heterogeneous_sizes": "M_He-I_Ho",
}
# Harder chains get more steps or a larger model; the ratios average to 1 so
# the total is the homogeneous one.
STEP_RATIOS = {"hard": 1.25, "moderate": 1.0, "easy": 0.75}
CHAIN_SIZES = {"hard": "L", "moderate": "M", "easy": "S"}
FFN_RATIOS = {"S": 0.75, "M": 1.0, "L": 1.25}


def ffn_widths(d_ff_medium: int, multiple: int = 8) -> dict[str, int]:
  """Feed-forward widths of S, M and L that keep FLOPs(S) + FLOPs(L) = 2 FLOPs(M).

  Args:
    d_ff_medium: the M model's feed-forward width.
    multiple: widths are rounded to a multiple of this (hardware-friendly);
      pick `d_ff_medium` divisible by ``4 * multiple`` for exact equality.

  Returns:
    ``{"S": 0.75 d, "M": d, "L": 1.25 d}`` rounded to `multiple`.
  """
  if d_ff_medium <= 0 or multiple <= 0:
    raise ValueError(f"ffn_widths: d_ff_medium ({d_ff_medium}) and multiple ({multiple}) "
                     "must be positive")
  return {size: max(multiple, multiple * round(d_ff_medium * ratio / multiple))
          for size, ratio in FFN_RATIOS.items()}


@dataclasses.dataclass(frozen=True)
class ChainPlan:
  """One expert chain: which domains, in which order, at which size and for how long.

  Attributes:
    chain: ``hard``, ``moderate`` or ``easy``.
    domains: the domains trained in turn; each continues from the previous
      domain's checkpoint.
    size: ``S``, ``M`` or ``L``.
    steps_per_domain: optimizer steps on each domain, same order as `domains`.
    flops_per_token: training FLOPs per token of `size`.
    tokens_per_step: tokens per optimizer step.
  """

  chain: str
  domains: tuple[str, ...]
  size: str
  steps_per_domain: tuple[int, ...]
  flops_per_token: float
  tokens_per_step: int

  @property
  def steps(self) -> int:
    return sum(self.steps_per_domain)

  @property
  def tokens(self) -> int:
    return self.steps * self.tokens_per_step

  @property
  def flops(self) -> float:
    return self.tokens * self.flops_per_token


@dataclasses.dataclass(frozen=True)
class Plan:
  """The chains of one setting and what they cost.

  Attributes:
    setting: a key of `SETTINGS`.
    chains: one `ChainPlan` per chain, hard first.
    budget_flops: the budget the plan was made for.
  """

  setting: str
  chains: tuple[ChainPlan, ...]
  budget_flops: float

  @property
  def paper_name(self) -> str:
    return SETTINGS[self.setting]

  @property
  def flops(self) -> float:
    return sum(c.flops for c in self.chains)

  def flops_by_chain(self) -> dict[str, float]:
    return {c.chain: c.flops for c in self.chains}

  def chain(self, name: str) -> ChainPlan:
    for c in self.chains:
      if c.chain == name:
        return c
    raise ValueError(f"plan has no chain {name!r}; it has {[c.chain for c in self.chains]}")


def _check_chains(chains: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
  if set(chains) != set(chains_lib.CHAIN_NAMES):
    raise ValueError(f"chains must have exactly the keys {list(chains_lib.CHAIN_NAMES)}, "
                     f"got {sorted(chains)}")
  for names in chains.values():
    if not names:
      raise ValueError("every chain needs at least one domain")
    for name in names:
      domains_lib.get_domain(name)  # ValueError naming the allowed domains.
  return {c: tuple(chains[c]) for c in chains_lib.CHAIN_NAMES}


def _flops_of_sizes(flops_per_token: Callable[[str], float]) -> dict[str, float]:
  flops = {size: float(flops_per_token(size)) for size in SIZE_NAMES}
  for size, value in flops.items():
    if not (value > 0 and math.isfinite(value)):
      raise ValueError(f"flops_per_token({size!r}) must be a positive number, got {value}")
  if not flops["S"] <= flops["M"] <= flops["L"]:
    raise ValueError(f"flops_per_token must grow from S to M to L, got {flops}")
  return flops


def base_steps_for_budget(budget_flops: float, flops_per_token: Callable[[str], float],
                          tokens_per_step: int, chains: Mapping[str, Sequence[str]],
                          step_multiple: int = 4) -> int:
  """The homogeneous setting's steps per domain that fit in `budget_flops`.

  Rounded down to a multiple of `step_multiple` (4 makes 1.25x and 0.75x whole).

  Raises:
    ValueError: the budget cannot pay `step_multiple` steps per domain of the
      M model (the smallest homogeneous expert), or a bad argument.
  """
  chains = _check_chains(chains)
  if tokens_per_step <= 0 or step_multiple <= 0:
    raise ValueError(f"tokens_per_step ({tokens_per_step}) and step_multiple "
                     f"({step_multiple}) must be positive")
  flops = _flops_of_sizes(flops_per_token)
  num_domains = sum(len(names) for names in chains.values())
  flops_per_step_all = num_domains * tokens_per_step * flops["M"]
  minimum = step_multiple * flops_per_step_all
  if not budget_flops >= minimum:
    raise ValueError(
        f"budget_flops={budget_flops:.3e} is too small: the smallest expert plan "
        f"({step_multiple} steps on each of {num_domains} domains for M-sized experts at "
        f"{tokens_per_step} tokens/step) needs {minimum:.3e} FLOPs")
  return step_multiple * int(budget_flops // (step_multiple * flops_per_step_all))


def budget_for_steps(steps_per_domain: int, flops_per_token: Callable[[str], float],
                     tokens_per_step: int, chains: Mapping[str, Sequence[str]]) -> float:
  """The FLOPs of the homogeneous setting at `steps_per_domain` (the paper's 400)."""
  chains = _check_chains(chains)
  if steps_per_domain < 1 or tokens_per_step < 1:
    raise ValueError(f"steps_per_domain ({steps_per_domain}) and tokens_per_step "
                     f"({tokens_per_step}) must be >= 1")
  num_domains = sum(len(names) for names in chains.values())
  return float(steps_per_domain * num_domains * tokens_per_step
               * _flops_of_sizes(flops_per_token)["M"])


def make_plan(setting: str, budget_flops: float, flops_per_token: Callable[[str], float],
              tokens_per_step: int, chains: Mapping[str, Sequence[str]], *,
              step_multiple: int = 4, tolerance: float = 0.02) -> Plan:
  """Sizes and steps of each chain for one setting, at the homogeneous budget.

  Args:
    setting: ``homogeneous``, ``heterogeneous_steps`` or ``heterogeneous_sizes``
      (the paper's ``M_Ho-I_Ho``, ``M_Ho-I_He``, ``M_He-I_Ho`` are accepted too).
    budget_flops: training FLOPs for the whole ensemble. The homogeneous plan
      uses the largest multiple of `step_multiple` steps per domain that fits;
      the others match that plan's FLOPs.
    flops_per_token: training FLOPs per token of a size name (S, M, L).
    tokens_per_step: tokens per optimizer step (batch x sequence length).
    chains: ``{"hard": domains, "moderate": domains, "easy": domains}``, for
      instance `lowcomm_jax.hdee.domains.measured_chains()`.
    step_multiple: the homogeneous steps per domain are a multiple of this.
    tolerance: the largest allowed relative difference between this plan's
      FLOPs and the homogeneous plan's.

  Returns:
    A `Plan`.

  Raises:
    ValueError: unknown setting or domain, a budget too small for the smallest
      expert, or sizes whose FLOPs break the equal-compute tolerance.
  """
  by_paper_name = {v: k for k, v in SETTINGS.items()}
  setting = by_paper_name.get(setting, setting)
  if setting not in SETTINGS:
    raise ValueError(f"unknown HDEE setting {setting!r}; allowed: {', '.join(SETTINGS)} "
                     f"(or {', '.join(SETTINGS.values())})")
  chains = _check_chains(chains)
  flops = _flops_of_sizes(flops_per_token)
  base = base_steps_for_budget(budget_flops, flops_per_token, tokens_per_step, chains,
                               step_multiple)
  chain_plans = []
  for chain, names in chains.items():
    size = CHAIN_SIZES[chain] if setting == "heterogeneous_sizes" else "M"
    ratio = STEP_RATIOS[chain] if setting == "heterogeneous_steps" else 1.0
    steps = max(1, round(base * ratio))
    chain_plans.append(ChainPlan(chain, names, size, (steps,) * len(names), flops[size],
                                 tokens_per_step))
  plan = Plan(setting, tuple(chain_plans), float(budget_flops))
  reference = base * tokens_per_step * flops["M"] * sum(len(n) for n in chains.values())
  gap = abs(plan.flops - reference) / reference
  if gap > tolerance:
    raise ValueError(
        f"setting {setting!r} spends {plan.flops:.4e} FLOPs, {100 * gap:.2f}% away from the "
        f"homogeneous {reference:.4e} (tolerance {100 * tolerance:.1f}%): chains of unequal "
        "length, or S/L sizes whose FLOPs do not average to M's; build the sizes with "
        f"ffn_widths() (flops_per_token gave {flops})")
  return plan


def make_plans(budget_flops: float, flops_per_token: Callable[[str], float],
               tokens_per_step: int, chains: Mapping[str, Sequence[str]], *,
               step_multiple: int = 4, tolerance: float = 0.02) -> dict[str, Plan]:
  """`make_plan` for all three settings, keyed by setting."""
  return {setting: make_plan(setting, budget_flops, flops_per_token, tokens_per_step, chains,
                             step_multiple=step_multiple, tolerance=tolerance)
          for setting in SETTINGS}


def format_plans(plans: Mapping[str, Plan]) -> str:
  """A Markdown table: per setting, each chain's size, steps and FLOPs, and the total."""
  chain_names = chains_lib.CHAIN_NAMES
  header = (
    "| setting | "
    + " | ".join(f"{c} chain: size, steps/domain, FLOPs" for c in chain_names)
    + " | total FLOPs | vs homogeneous |"
  )
  lines = [header, "|---" * (len(chain_names) + 3) + "|"]
  reference = plans["homogeneous"].flops if "homogeneous" in plans else None
  for setting, plan in plans.items():
    cells = [f"{c.size}, {c.steps_per_domain[0]}, {c.flops:.3e}"
             for c in (plan.chain(name) for name in chain_names)]
    ratio = f"{plan.flops / reference:.4f}" if reference else "-"
    lines.append(f"| {setting} ({plan.paper_name}) | " + " | ".join(cells)
                 + f" | {plan.flops:.4e} | {ratio} |")
  return "\n".join(lines)
