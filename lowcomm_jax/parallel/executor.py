"""Runs a `TickTable` on a (replica, stage) mesh: one `comm.permute` per direction per tick.

`jax.shard_map` over the mesh axes `replica` and `stage` gives each device its stage's slice of its
replica's parameters (grid layout, `stages.py`). The program scans over the ticks; in each tick a
device reads its own op and micro-batch from the table and runs one of

  idle | F: x ← layers(x_in)  (stage 0: layers(embed(tokens)))
       | L: loss, ∂loss/∂x, ∂loss/∂(final norm, head)  (on the origin, stage 0)
       | B: recompute layers(x_in) and pull ∂/∂x back through it  (stage 0: into the embedding)



(a `lax.switch` on a per-device index: only the taken branch runs), then the tick's two static
permutations move the activations forward and the gradients backward. Ticks with the same pair of
permutations share one branch of a second `lax.switch`, so compile time grows with the number of
distinct transfer patterns, not with the number of ticks. Each device keeps, per micro-batch, the
activation that reached it (its input, kept for the backward: the stage's forward is recomputed
there) and the gradient that reached it. Gradients of all micro-batches a device served are summed.

The executor also counts, at run time, how many ticks each device spent in each branch: the measured
busy and idle ticks, to compare with the plan and with the simulator (`bubble.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from lowcomm_jax import comm, mesh as mesh_lib
from lowcomm_jax.parallel import ticks as ticks_lib
from lowcomm_jax.parallel.stages import StageFunctions

GRID = P(mesh_lib.REPLICA, mesh_lib.STAGE)  # leaves [R, S, ...]: one slice per device
_AXES = (mesh_lib.REPLICA, mesh_lib.STAGE)  # device index r·S + s in ppermute and axis_index
# Branches of the per-device switch (the tick table's op codes); counters use the same indices.
_IDLE, _F, _L, _B = ticks_lib.IDLE, ticks_lib.FORWARD, ticks_lib.LOSS, ticks_lib.BACKWARD


@dataclasses.dataclass(frozen=True)
class PipelineResult:
  """One pass over a batch.

  loss: Σ over micro-batches of loss_scale · loss_m (float32 scalar).
  grads: gradients in grid layout (leaves [R, S, ...]).
  busy_ticks: int[D], ticks each device computed (measured in the program), device d = r·S + s.
  idle_ticks: int[D], num_ticks − busy_ticks.
  num_ticks: the table's length.
  """

  loss: jax.Array
  grads: object
  busy_ticks: np.ndarray
  idle_ticks: np.ndarray
  num_ticks: int


def transfer_patterns(table: ticks_lib.TickTable):
  """(pattern id per tick int32[T], the distinct (activation perm, gradient perm) pairs)."""
  pairs = list(zip(table.permutations("act"), table.permutations("grad")))
  distinct = sorted(set(pairs))
  index = {p: i for i, p in enumerate(distinct)}
  return np.array([index[p] for p in pairs], np.int32), distinct


def grid_mesh(table: ticks_lib.TickTable, devices=None):
  return mesh_lib.make_mesh({mesh_lib.REPLICA: table.num_replicas,
                             mesh_lib.STAGE: table.num_stages},
                            devices)


def make_pipeline_grads(stage_fns: StageFunctions, table: ticks_lib.TickTable, mesh,
                        loss_scale: float) -> Callable:
  """(grid params, batch [M, B, T+1]) → (loss, grid grads, op counts int[R, S, 4]), not jitted: a
  caller traces it inside its own program, so its `comm.permute` calls record their bytes in the
  ledger on every trace (a jitted inner function's cached trace would record nothing).

  The table is validated here, before anything is traced. The batch is replicated on every device
  (stage-0 devices read their micro-batches' tokens; the origin reads the targets for the loss).
  """
  ticks_lib.validate(table)
  num_stages, num_mb = table.num_stages, table.num_microbatches
  pattern_T, patterns = transfer_patterns(table)
  op_TxD = jnp.asarray(table.op, jnp.int32)
  mb_TxD = jnp.asarray(np.maximum(table.microbatch, 0), jnp.int32)
  recv_act_TxD = jnp.asarray(table.received("act"))
  recv_grad_TxD = jnp.asarray(table.received("grad"))

  ticks_per_pattern = np.bincount(pattern_T, minlength=len(patterns))

  def transfer(pattern, msg):
    def move(perm, name, ticks):
      return comm.permute(msg, _AXES, perm, name, int(ticks)) if perm else jnp.zeros_like(msg)
    return lax.switch(pattern, [
        lambda a=a, g=g, n=n: (move(a, "pipeline activations", n), move(g, "pipeline gradients", n))
        for (a, g), n in zip(patterns, ticks_per_pattern)])

  def device_program(params, batch_MxBxT1):
    params = jax.tree.map(lambda x: x[0, 0], params)
    me = lax.axis_index(_AXES)
    first_stage = lax.axis_index(mesh_lib.STAGE) == 0
    b, t1 = batch_MxBxT1.shape[1:]
    act_shape = (num_mb, b, t1 - 1, stage_fns.cfg.d_model)
    zeros = jax.tree.map(jnp.zeros_like, params)
    add = lambda tree, delta: jax.tree.map(jnp.add, tree, delta)

    def branches(m, act, grad, grads, loss, counts):
      tokens, targets = batch_MxBxT1[m, :, :-1], batch_MxBxT1[m, :, 1:]
      outer = {k: v for k, v in params.items() if k != "blocks"}

      def stage_input(o, x):
        # Stage 0 starts from the tokens (F and B on stage 0 are always a route's first and last);
        # one branch for every stage keeps a single copy of the layers in the program. The
        # embedding's gradient through the unselected side is exactly zero.
        return jnp.where(first_stage, stage_fns.embed(o, tokens), x)

      def idle():
        return jnp.zeros(act_shape[1:], stage_fns.dtype), grads, loss, counts.at[_IDLE].add(1)

      def forward():
        y = stage_fns.layers(params["blocks"], stage_input(outer, act[m]))
        return y, grads, loss, counts.at[_F].add(1)

      def loss_op():
        value, (g_outer, g_x) = jax.value_and_grad(
          lambda o, x: loss_scale * stage_fns.head_loss(o, x, targets), argnums=(0, 1)
        )(outer, act[m])
        return (
          g_x.astype(stage_fns.dtype),
          add(grads, {**zeros, **g_outer}),
          loss + value,
          counts.at[_L].add(1),
        )

      def backward():
        _, pull = jax.vjp(lambda blocks, o, x: stage_fns.layers(blocks, stage_input(o, x)),
                          params["blocks"], outer, act[m])
        g_blocks, g_outer, g_x = pull(grad[m])
        return g_x, add(grads, {**g_outer, "blocks": g_blocks}), loss, counts.at[_B].add(1)

      return [idle, forward, loss_op, backward]

    def tick(carry, xs):
      act, grad, grads, loss, counts = carry
      op_row, mb_row, recv_act_row, recv_grad_row, pattern = xs
      op, m = op_row[me], mb_row[me]
      msg, grads, loss, counts = lax.switch(op, branches(m, act, grad, grads, loss, counts))
      act_in, grad_in = transfer(pattern, msg)
      act = _store(act, recv_act_row[me], act_in)
      grad = _store(grad, recv_grad_row[me], grad_in)
      return (act, grad, grads, loss, counts), None

    carry = (jnp.zeros(act_shape, stage_fns.dtype), jnp.zeros(act_shape, stage_fns.dtype), zeros,
             jnp.zeros((), jnp.float32), jnp.zeros((4,), jnp.int32))
    xs = (op_TxD, mb_TxD, recv_act_TxD, recv_grad_TxD, jnp.asarray(pattern_T))
    (_, _, grads, loss, counts), _ = lax.scan(tick, carry, xs)
    expand = lambda x: x[None, None]
    return expand(loss), jax.tree.map(expand, grads), expand(counts)

  # check_vma=False: every output is per device anyway, and the branches mix values that vary over
  # the mesh (activations) with constants (an idle device's zeros).
  # The mesh is looked up when traced: a context's abstract mesh with the same axes stands
  # (`mesh.tracing`).
  return lambda *args: jax.shard_map(device_program, mesh=mesh_lib.current(mesh),
                                     in_specs=(GRID, P()), out_specs=(GRID, GRID, GRID),
                                     check_vma=False)(*args)


def _store(buffer, microbatch, value):
  """buffer[microbatch] = value when microbatch >= 0 (a message arrived), else buffer unchanged."""
  slot = jnp.maximum(microbatch, 0)
  return buffer.at[slot].set(jnp.where(microbatch >= 0, value.astype(buffer.dtype), buffer[slot]))


class PipelineExecutor:
  """A tick table compiled for a mesh: call it on grid parameters and a batch."""

  def __init__(self, stage_fns: StageFunctions, table: ticks_lib.TickTable, mesh=None,
               loss_scale: float | None = None):
    self.table = table
    self.mesh = grid_mesh(table) if mesh is None else mesh
    origins_per_replica = np.bincount([r.origin for r in table.routes],
                                      minlength=table.num_replicas)
    # Each replica's gradient is the mean over the micro-batches it started (as one data-parallel
    # worker's), unless told otherwise.
    self.loss_scale = float(1.0 / origins_per_replica.max() if loss_scale is None else loss_scale)
    # (grid params, batch) -> (loss [R, S], grads, op counts): traced inside a larger program.
    self.grads_fn = make_pipeline_grads(stage_fns, table, self.mesh, self.loss_scale)
    self._jitted = jax.jit(self.grads_fn)

  def compiled_text(self, grid_params, batch_MxBxT1) -> str:
    """The compiled program's HLO (to check which collectives it holds)."""
    return self._jitted.lower(grid_params, jnp.asarray(batch_MxBxT1)).compile().as_text()

  def __call__(self, grid_params, batch_MxBxT1) -> PipelineResult:
    if np.ndim(batch_MxBxT1) != 3 or np.shape(batch_MxBxT1)[0] != self.table.num_microbatches:
      raise ValueError(f"batch: expected int tokens "
                       f"[num_microbatches={self.table.num_microbatches}, B, T + 1], got "
                       f"shape {np.shape(batch_MxBxT1)}")
    loss_RS, grads, counts_RSx4 = self._jitted(grid_params, jnp.asarray(batch_MxBxT1))
    counts = np.asarray(counts_RSx4).reshape(self.table.num_devices, 4)
    busy = counts[:, 1:].sum(1)
    return PipelineResult(loss_RS.sum(), grads, busy, counts[:, _IDLE], self.table.num_ticks)
