"""An asynchronous run's merge log, read back: `replay` rebuilds the syncer's φ on one process from
φ_0 and the logged Δ (`elastic.log_deltas`), through the syncer's own outer-step program, in the
log's order. It reads the run and writes nothing (docs/elastic.md)."""

from __future__ import annotations

import json
import pathlib

import jax
import ml_collections
import numpy as np

from lowcomm_jax.comm import plan as plan_lib
from lowcomm_jax.elastic import options
from lowcomm_jax.elastic.syncer import MERGE_LOG, host, outer_step_program, weighted


def replay(run_dir) -> dict:
  """φ of an asynchronous run with `elastic.log_deltas`, rebuilt on this process from φ_0 and its
  merge log (each logged Δ through the same outer step program, in the log's order). Reads the
  run, writes nothing. Returns {"phi": the rebuilt φ, "saved": the syncer's latest φ, "merges":
  merges replayed}."""
  from lowcomm_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  run_dir = pathlib.Path(run_dir)
  c = ml_collections.ConfigDict(json.loads((run_dir / "config.json").read_text())["config"])
  folder = run_dir / "syncer"
  saved = checkpoint.sealed_steps(folder / "checkpoints")
  if 1 not in saved:
    raise ValueError(f"{folder}: the first save (φ_0) is no longer kept: replay needs "
                     "checkpoint.keep large enough to keep it")
  first, last = (host(checkpoint.read_step(folder, step)["phi"]) for step in (1, max(saved)))
  params = first
  algorithm = options.outer_algorithm(c, params)
  tx = algorithm.tx
  shared = host(plan_lib.shared_part(tx.state_axes, tx.init(params)))
  names = options.plan_names(tx)
  consumed = {n: ph for ph in tx.phases for n in tx.consumes(ph)}
  sends = {n: ph for ph in tx.phases for n in tx.plans(ph)}
  # per plan: its tree's structure, and its outer step compiled at the first merge
  structures = {n: jax.tree.structure(jax.eval_shape(lambda n=n: tx.local(shared, params,
                                                                          sends[n])[n]))
                for n in names}
  programs = {}
  merges = [json.loads(l) for l in (folder / MERGE_LOG).read_text().splitlines()]
  for m in (m for m in merges if m["weight"] > 0):
    with np.load(folder / "merges" / f"{m['merge']}.npz") as z:
      leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
    name = names[m["fragment"]]
    mean = weighted(jax.tree.unflatten(structures[name], leaves), m["weight"])
    if name not in programs:
      programs[name] = outer_step_program(tx, name, consumed[name], shared, params, mean)
    shared = host(programs[name](shared, params, mean))
  return {"phi": host(algorithm.eval_params(None, shared)), "saved": last,
          "merges": sum(m["weight"] > 0 for m in merges)}
