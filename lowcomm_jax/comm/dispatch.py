"""The one dispatcher of outer communication: `carry(plan, tree, ...)` runs a `comm.Plan`.

It is the only place that chooses between the mean, the compressed mean, the group mean and the
sparse gather. A step program calls it inline (`compose`: local → carry → apply); the outer-
communication thread (`comm.OuterCommExecutor`) runs the same `carry`, vmapped over the replicas,
on its own thread (`over_replicas`). Every entry it records in the ledger carries the plan's name
(`Entry.plan`), from which the clock and the byte summaries are derived.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.comm import collectives, ledger
from lowcomm_jax.comm.compressed_mean import compressed_mean
from lowcomm_jax.comm.plan import CommState, Plan
from lowcomm_jax.comm.sparse_mean import sparse_mean

__all__ = ["carry", "carry_phase", "incoming", "over_replicas", "plan_key"]


def plan_key(plan: Plan, count) -> jax.Array | None:
  """Stochastic rounding's key for the send taken at `count` inner steps: the same on every
  replica and run, fresh per send; None when the codec rounds to nearest."""
  if getattr(plan.codec, "rounding", "nearest") != "stochastic":
    return None
  return jax.random.fold_in(jax.random.key(plan.seed), count)


def carry(plan: Plan, tree: Any, axis_name: str, *, name: str, residual: Any = None,
          key: jax.Array | None = None, grouping: jax.Array | None = None):
  """`tree` carried over `axis_name` as `plan` says; call under a bound replica axis.

  Args:
    plan: the `comm.Plan`.
    tree: this replica's tree (float32 leaves).
    axis_name: the bound replica axis.
    name: the plan's name (the ledger entries' `name` and `plan`).
    residual: with `plan.error_feedback`, this replica's residual (same structure), else None.
    key: stochastic rounding's key (`plan_key`).
    grouping: group_mean only: the index into `plan.groupings` (traced, the same on every replica;
      `lax.switch` runs only its branch's permutes).

  Returns:
    The carried result (the same on every replica, except group_mean: the same within a group);
    with a residual, `(result, new residual)`.
  """
  if plan.error_feedback != (residual is not None):
    raise ValueError(f"plan {name!r}: error_feedback={plan.error_feedback} but residual "
                     f"{'missing' if residual is None else 'given'}")
  if residual is not None and plan.feedback_decay != 1.0:
    residual = jax.tree.map(lambda e: plan.feedback_decay * e, residual)
  with ledger.carrying(name):
    if plan.kind == "mean":
      return collectives.mean(tree, axis_name, name=name)
    if plan.kind == "compressed_mean":
      return compressed_mean(tree, axis_name, plan.codec, name, key=key, residual=residual,
                             kernels=plan.kernels)
    if plan.kind == "group_mean":
      if residual is not None:
        raise ValueError(f"plan {name!r}: group_mean has no error feedback")
      return _group_mean(plan, tree, axis_name, name, grouping)
    # β was applied above, as for the compressed mean
    return sparse_mean(tree, axis_name, plan.codec, name, residual=residual, decay=1.0)


def _group_mean(plan: Plan, tree, axis_name: str, name: str, grouping):
  return _group_means({name: plan}, {name: tree}, axis_name, grouping)[name]


def _group_means(plans: dict, trees: dict, axis_name: str, grouping) -> dict:
  """Group means of every tree in one `lax.switch`, one branch per entry of the plans' (shared)
  pool of groupings, each with its own static permutations; the index is the same on every replica
  (unmapped), so only the taken branch's permutes run. Every branch moves the same bytes, so the
  ledger records one branch's entries."""
  [pool] = {id(p.groupings): p.groupings for p in plans.values()}.values()
  recorded = []

  def exchange(groups, trees):
    results = {}
    with ledger.Ledger().recording() as branch_ledger:
      for name, plan in plans.items():
        with ledger.carrying(name):
          results[name] = collectives.group_mean(trees[name], axis_name, groups, name=name,
                                                 codec=plan.codec)
    recorded.append(branch_ledger.entries)
    return results

  branches = [functools.partial(exchange, groups) for groups in pool]
  if len(branches) == 1:
    results = branches[0](trees)
  else:
    results = jax.lax.switch(grouping, branches, trees)
  ledger.add(recorded[0])
  return results


def over_replicas(plan: Plan, name: str, axis_name: str = mesh_lib.REPLICA):
  """`(tree_R, residual_R, key) -> result_R` (or `(result_R, new residual_R)`): `carry` vmapped
  over a leading replica axis, the program the outer-communication thread runs.

  Traced under a mesh holding `axis_name` (`mesh.tracing`), the leading axis is laid out over it
  (`spmd_axis_name`), so that a codec's compiled kernels, which run under a `shard_map` over every
  mesh axis, take each replica's slice where it lives instead of gathering the tree.
  """

  def per_replica(tree, residual, key):
    return carry(plan, tree, axis_name, name=name, residual=residual, key=key)

  def run(tree, residual=None, key=None):
    # the tree and the residual are per replica; the key is the same on every replica
    in_axes = (0, None if residual is None else 0, None)
    spmd = axis_name if axis_name in jax.sharding.get_abstract_mesh().axis_names else None
    return jax.vmap(per_replica, in_axes=in_axes, axis_name=axis_name,
                    spmd_axis_name=spmd)(tree, residual, key)

  return run


def carry_phase(step, state, params, phase, axis_name: str, *, delayed: bool, grouping=None):
  """Carries the plans of `step.plans(phase)` with delay ≥ 1 (`delayed`) or 0, in the order the
  algorithm lists them, from `step.local(state, params, phase)`.

  Args:
    step: the algorithm (`comm.plan.OuterStep`); its state has a `comm` field (`CommState`) and an
      int32 `count` (inner steps taken: stochastic rounding's key).
    state, params, phase: as `step.local` takes them (delayed: the parameters entering the step;
      else those after its inner update).
    axis_name: the bound replica axis.
    delayed: which plans.
    grouping: passed to group_mean plans (`carry`).

  Returns:
    (results by name, the state with its new residuals); with `delayed`, the results are written
    into `state.comm.in_flight` instead and the dict is empty.
  """
  plans = {n: p for n, p in step.plans(phase).items() if bool(p.delay) == delayed}
  if not plans:
    return {}, state
  trees = step.local(state, params, phase)
  in_flight, residuals = dict(state.comm.in_flight), dict(state.comm.residuals)
  # group means that share a pool of groupings run in one switch (one grouping per step)
  grouped = {n: p for n, p in plans.items() if p.kind == "group_mean"}
  results = _group_means(grouped, trees, axis_name, grouping) if grouped else {}
  for name, plan in plans.items():
    if name in grouped:
      continue
    key = plan_key(plan, state.count)
    if plan.error_feedback:
      results[name], residuals[name] = carry(plan, trees[name], axis_name, name=name,
                                             residual=residuals[name], key=key, grouping=grouping)
    else:
      results[name] = carry(plan, trees[name], axis_name, name=name, key=key, grouping=grouping)
  if delayed:
    in_flight.update(results)
    results = {}
  return results, state._replace(comm=CommState(in_flight, residuals))


def incoming(step, state, phase, carried: dict) -> dict:
  """What `step.apply` consumes in `phase`: each name's result carried in this step, else its
  in-flight buffer."""
  return {n: carried[n] if n in carried else state.comm.in_flight[n] for n in step.consumes(phase)}
