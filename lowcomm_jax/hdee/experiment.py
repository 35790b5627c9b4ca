"""The HDEE experiment: plan, train and evaluate the three settings; the per-domain table.

`run_experiment` is what ``experiments/hdee.py`` runs (and the colab, on a
tiny model). For each setting of `lowcomm_jax.hdee.plan` it trains the three
expert chains (`lowcomm_jax.hdee.experts`), then scores every evaluation
domain's test split with:

- the posterior-weighted ensemble, with the uniform prior and with the cached
  prior built from the domain's validation sequences (docs/algorithms.md §4.2);
- the single best expert, chosen on the validation sequences;
- the parameter-averaged model: the mean of the setting's expert parameters,
  defined only when its experts share a size (not for heterogeneous sizes).

A domain is won by the setting whose cached-prior ensemble (the paper's
method) has the lowest test perplexity. Compute per setting is the FLOPs
formula times the tokens each expert run actually trained; seeds are charged
separately, as the paper does not count its seed pretraining either.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from lowcomm_jax.data import domains as domains_lib
from lowcomm_jax.hdee import (
  domains as chains_lib,
  ensemble,
  experts as experts_lib,
  plan as plan_lib,
  scoring,
)

COMPUTE_TOLERANCE = 0.02
# Ensemble and baseline columns of the table, in order.
METHODS = ("uniform_prior", "cached_prior", "best_expert", "parameter_average")
WIN_METHOD = "cached_prior"
SHORT_NAMES = {"homogeneous": "Ho", "heterogeneous_steps": "He-steps",
               "heterogeneous_sizes": "He-sizes"}


def _log(message: str) -> None:
  print(f"[hdee {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_experiment(root: str | pathlib.Path, setup: experts_lib.ExpertSetup, steps_per_domain: int,
                   chains: Mapping[str, Sequence[str]] = chains_lib.REFERENCE_CHAINS,
                   eval_domains: Sequence[str] | None = None, validation_sequences: int = 32,
                   test_sequences: int = 64, log: Callable[[str], None] = _log) -> dict:
  """Trains and evaluates all three settings; returns the results (also `root`/results.json).

  Args:
    root: folder of every run, the cached log-probs and the results.
    setup: model size, batch, seed training and learning rates.
    steps_per_domain: the homogeneous setting's steps on each domain (a
      multiple of 4); the others get the same FLOPs.
    chains: ``{"hard": domains, "moderate": ..., "easy": ...}``.
    eval_domains: domains to score; None means all 16.
    validation_sequences: validation windows per domain for the cached prior
      and the choice of best expert.
    test_sequences: test windows per domain that are scored.
    log: progress messages.

  Returns:
    A JSON-ready dict: ``settings`` (plan and compute), ``domains`` (per
    domain and setting, every method's perplexity), ``wins``.

  Raises:
    ValueError: an unknown domain, a bad step count, or settings whose spent
      compute differs by more than `COMPUTE_TOLERANCE`.
  """
  root = pathlib.Path(root).absolute()
  eval_domains = list(domains_lib.DOMAINS if eval_domains is None else eval_domains)
  for name in eval_domains:
    domains_lib.get_domain(name)
  if validation_sequences < 1 or test_sequences < 1:
    raise ValueError(f"validation_sequences ({validation_sequences}) and test_sequences "
                     f"({test_sequences}) must be >= 1")
  plans = experts_lib.make_plans(setup, steps_per_domain, chains)
  log("plan:\n" + plan_lib.format_plans(plans))
  domains_lib.fetch_domains(sorted(set(eval_domains) | set(experts_lib.plan_domains(
      plans["homogeneous"]))))

  started = time.perf_counter()
  final = {}
  for setting, plan in plans.items():
    log(f"training {setting}")
    final[setting] = experts_lib.train_plan(setup, plan, root)
  train_seconds = time.perf_counter() - started

  spent = {s: experts_lib.spent_flops(p, root) for s, p in plans.items()}
  totals = {s: sum(by_chain.values()) for s, by_chain in spent.items()}
  reference = totals["homogeneous"]
  gaps = {s: total / reference - 1.0 for s, total in totals.items()}
  seed_flops = {size: experts_lib.run_flops(experts_lib.seed_workdir(root, size))
                for size in sorted({c.size for p in plans.values() for c in p.chains})}

  log("evaluating")
  started = time.perf_counter()

  def log_probs_of(key: str, make_expert):
    return scoring.cached_log_probs(
        root / "eval" / f"{key}.npz", make_expert, eval_domains, setup.seq_len,
        validation_sequences, test_sequences)

  by_workdir: dict[pathlib.Path, dict] = {}
  for workdirs in final.values():
    for workdir in workdirs.values():
      if workdir not in by_workdir:
        by_workdir[workdir] = log_probs_of(
            workdir.parent.name, lambda w=workdir: scoring.load_expert(w))
  averaged = {}
  for setting, plan in plans.items():
    if len({c.size for c in plan.chains}) == 1:
      averaged[setting] = log_probs_of(f"average_{setting}", lambda s=setting: (
          scoring.average_parameters([scoring.load_expert(w)
                                          for w in final[s].values()])))

  table = {}
  chain_of = {d: c for c, ds in chains.items() for d in ds}
  for name in eval_domains:
    domain = domains_lib.get_domain(name)
    row = {"held_out": domain.held_out,
           "role": "held out" if domain.held_out else chain_of.get(name, "not trained")}
    for setting, plan in plans.items():
      names = [c.chain for c in plan.chains]
      stacked = {split: np.stack([by_workdir[final[setting][c]][name][split] for c in names])
                 for split in ("validation", "test")}
      scores = dict(ensemble.evaluate_domain(stacked["validation"], stacked["test"]))
      scores["best_expert_name"] = names[scores["best_expert_index"]]
      scores["parameter_average"] = (
          float(ensemble.perplexity(averaged[setting][name]["test"]))
          if setting in averaged else None)
      row[setting] = scores
    table[name] = row

  results = {
      "setup": {k: v for k, v in vars(setup).items()},
      "steps_per_domain": steps_per_domain,
      "chains": {c: list(ds) for c, ds in chains.items()},
      "validation_sequences": validation_sequences,
      "test_sequences": test_sequences,
      "settings": {s: {
          "paper_name": p.paper_name,
          "chains": {c.chain: {"size": c.size, "d_ff": setup.model(c.size).d_ff,
                               "steps_per_domain": list(c.steps_per_domain),
                               "domains": list(c.domains),
                               "final_workdir": str(final[s][c.chain])} for c in p.chains},
          "planned_flops": p.flops,
          "spent_flops": totals[s],
          "spent_flops_by_chain": spent[s],
          "vs_homogeneous": gaps[s],
      } for s, p in plans.items()},
      "seed_flops": seed_flops,
      "domains": table,
      "wins": count_wins(table, list(plans)),
      "wins_uniform_prior": count_wins(table, list(plans), "uniform_prior"),
      "train_seconds_this_invocation": train_seconds,
      "eval_seconds": time.perf_counter() - started,
  }
  (root / "results.json").write_text(json.dumps(results, indent=1, default=str))
  (root / "results.md").write_text(format_results(results))
  plot_results(results, root / "results.png")
  bad = {s: g for s, g in gaps.items() if abs(g) > COMPUTE_TOLERANCE}
  if bad:
    raise ValueError(f"spent compute differs from the homogeneous setting's by more than "
                     f"{100 * COMPUTE_TOLERANCE:.0f}%: {bad} (see {root / 'results.json'})")
  log(f"wrote {root / 'results.md'}, results.json and results.png")
  return results


def count_wins(table: Mapping[str, Mapping], settings: Sequence[str],
               method: str = WIN_METHOD) -> dict[str, int]:
  """Per setting, the domains where its `method` perplexity is the lowest; exact ties apart."""
  wins = {s: 0 for s in settings}
  wins["tie"] = 0
  for row in table.values():
    values = {s: row[s][method] for s in settings}
    best = min(values.values())
    winners = [s for s, v in values.items() if v == best]
    wins[winners[0] if len(winners) == 1 else "tie"] += 1
  return wins


def _cell(value) -> str:
  return "n/a" if value is None else f"{value:.3f}"


def format_results(results: Mapping) -> str:
  """Markdown: the compute per setting, the per-domain table and the wins."""
  settings = list(results["settings"])
  lines = ["| setting | chains (size, steps/domain) | spent FLOPs | vs homogeneous |",
           "|---|---|---|---|"]
  for s, info in results["settings"].items():
    chains = ", ".join(f"{c} {v['size']} {v['steps_per_domain'][0]}"
                       for c, v in info["chains"].items())
    lines.append(f"| {s} ({info['paper_name']}) | {chains} | {info['spent_flops']:.4e} | "
                 f"{100 * info['vs_homogeneous']:+.2f}% |")
  lines += ["", "Test perplexity (bytes). Per setting: U = ensemble with the uniform prior, "
            "C = ensemble with the cached prior, B = best single expert (chosen on validation), "
            "A = parameter-averaged model (same-size experts only). Bold: the lowest C of the row.",
            ""]
  header = ["domain", "role"] + [f"{SHORT_NAMES[s]} {m}" for s in settings for m in "UCBA"]
  lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
  for name, row in results["domains"].items():
    best = min(row[s][WIN_METHOD] for s in settings)
    cells = [name, row["role"]]
    for s in settings:
      for method in METHODS:
        text = _cell(row[s][method])
        if method == WIN_METHOD and row[s][method] == best:
          text = f"**{text}**"
        cells.append(text)
    lines.append("| " + " | ".join(cells) + " |")
  wins = results["wins"]
  lines += ["", "Domains won (lowest cached-prior ensemble perplexity): "
            + ", ".join(f"{s} {n}" for s, n in wins.items())
            + f" of {len(results['domains'])}."]
  wins = results["wins_uniform_prior"]
  lines += ["With the uniform prior instead: " + ", ".join(f"{s} {n}" for s, n in wins.items())
            + "."]
  return "\n".join(lines) + "\n"


def plot_results(results: Mapping, path: pathlib.Path) -> None:
  """Bars of the cached-prior ensemble perplexity per domain and setting, and vs homogeneous."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  settings = list(results["settings"])
  names = list(results["domains"])
  x = np.arange(len(names))
  width = 0.8 / len(settings)
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(names)), 7), sharex=True)
  for i, s in enumerate(settings):
    values = np.array([results["domains"][n][s][WIN_METHOD] for n in names])
    base = np.array([results["domains"][n]["homogeneous"][WIN_METHOD] for n in names])
    top.bar(x + (i - 1) * width, values, width,
            label=f"{s} ({results['settings'][s]['paper_name']})")
    bottom.bar(x + (i - 1) * width, 100 * (values / base - 1), width)
  best_single = np.array([min(results["domains"][n][s]["best_expert"] for s in settings)
                          for n in names])
  top.scatter(x, best_single, marker="_", color="k", s=200,
              label="best single expert (any setting)")
  top.set_yscale("log")
  top.set_ylabel("test perplexity (cached prior)")
  top.legend(fontsize=8)
  bottom.axhline(0, color="k", lw=0.5)
  bottom.set_ylabel("% vs homogeneous")
  labels = [f"{n}\n({results['domains'][n]['role']})" for n in names]
  bottom.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
  fig.suptitle("HDEE: per-domain test perplexity at equal compute")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
