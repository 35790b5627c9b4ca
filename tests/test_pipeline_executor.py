"""The pipeline executor on 8 fake CPU devices: gradients equal the sequential path computation, the
measured bubble equals the simulator's, and colliding schedules are refused before compilation."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lowcomm_jax
from lowcomm_jax import hlo, testing
from lowcomm_jax.models import get_model_config, llama
from lowcomm_jax.parallel import bubble, routing, stages, ticks
from lowcomm_jax.parallel.executor import PipelineExecutor, transfer_patterns
from lowcomm_jax.skippipe import paths, scheduler, topology
from lowcomm_jax.train import Trainer, sources

SEQ, MB_SIZE = 8, 2


def _model(num_layers, num_replicas):
  """A tiny decoder whose replicas all differ, so a wrong replica's weights change the result."""
  cfg = get_model_config("tiny", num_layers=num_layers, d_model=16, d_ff=32)
  graphdef = nnx.split(nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(0))), nnx.Param)[0]
  return cfg, graphdef, stages.random_replicas(cfg, num_replicas)


def skippipe_routes():
  """The SkipPipe scheduler's per-micro-batch paths on a 4-stage × 2-replica random cluster: skips,
  a swap (0, 3, 2) and paths that change replica between stages."""
  num_stages, num_replicas = 4, 2
  topo = topology.random_heterogeneous(1, (num_replicas,) * num_stages, layers_per_stage=1)
  placement = bubble.grid_placement(num_stages, num_replicas)
  config = paths.SkipConfig(path_length=3, microbatches_per_data_node=3, paths_per_data_node=3)
  return routing.routes_from_skippipe(scheduler.skippipe_schedule(topo, placement, config),
                                      placement)


CASES = {
    # name: (stages, replicas, routes, order)
    "full_pipeline_1f1b": (4, 2, routing.full_pipeline_routes(3, 4, 2), "1f1b"),
    "skippipe": (4, 2, skippipe_routes(), "gpipe"),
    "random_routing": (2, 4, routing.random_routes(2, 2, 4, seed=3), "gpipe"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_equal_sequential_paths_and_bubble_equals_simulator(name):
  num_stages, num_replicas, routes, order = CASES[name]
  cfg, graphdef, params_R = _model(num_stages, num_replicas)
  table = ticks.compile_ticks(routes, num_stages, num_replicas, order)
  batch = np.random.default_rng(0).integers(0, 256, (len(routes), MB_SIZE, SEQ + 1))
  executor = PipelineExecutor(stages.StageFunctions(cfg), table)
  got = executor(stages.to_grid(params_R, num_stages), batch)

  want_loss, want_grads = stages.sequential_loss_and_grads(graphdef, params_R, batch, routes,
                                                           num_stages, executor.loss_scale)
  # The executor sums every micro-batch's loss and gradient in another order than the sequential
  # reference: the decoder's chain of sums over all micro-batches' tokens (backward: twice), at the
  # compared values' scale.
  chain = testing.chain_of_sums(cfg, SEQ, len(routes) * MB_SIZE * SEQ)
  testing.assert_within(got.loss, want_loss, testing.sum_error_bound(abs(float(want_loss)), chain),
                        "loss")
  got_grads = stages.from_grid(got.grads)
  testing.assert_trees_within(got_grads, want_grads, lambda w: testing.sum_error_bound(
      np.max(np.abs(np.asarray(w))), 2 * chain), "gradient")
  # Non-block parameters live in stage slot 0 only; the other slots get exactly zero gradient.
  assert all(float(jnp.abs(x[:, 1:]).max()) == 0.0 for x in jax.tree.leaves(got.grads["head"]))

  # Measured in the program = planned = the simulator's prediction with unit costs.
  memory = len(routes) if order == "gpipe" else num_stages
  makespan, simulated_idle = bubble.simulated_idle_ticks(table, memory)
  assert got.num_ticks == makespan
  np.testing.assert_array_equal(got.idle_ticks, simulated_idle)
  np.testing.assert_array_equal(got.idle_ticks, table.idle_ticks())
  assert got.busy_ticks.sum() == sum(2 * len(r.stages) + 1 for r in routes)

  if name == "random_routing":
    # Transfers are static permutations only: one collective-permute per non-empty permutation of
    # each distinct (activation, gradient) pattern, and no other collective.
    lines = hlo.collectives(executor.compiled_text(stages.to_grid(params_R, num_stages), batch))
    kinds = {line.split("=")[1].split("(")[0].split()[-1] for line in lines}
    assert kinds <= {"collective-permute", "collective-permute-start", "collective-permute-done"}
    _, patterns = transfer_patterns(table)
    starts = [l for l in lines if "collective-permute-done" not in l.split("=")[1].split("(")[0]]
    assert len(starts) == sum(bool(a) + bool(g) for a, g in patterns)
    # The check is sensitive: fixed routing gives other gradients.
    _, fixed = stages.sequential_loss_and_grads(
        graphdef, params_R, batch, routing.full_pipeline_routes(2, 2, 4), num_stages,
        executor.loss_scale)
    assert not np.allclose(jax.tree.leaves(fixed["blocks"])[0],
                           jax.tree.leaves(want_grads["blocks"])[0])


def test_ledger_counts_every_tick_of_every_transfer():
  """comm.permute records each pattern once per tick that runs it: the ledger holds the bytes of
  every activation and gradient message of the table, averaged over the devices."""
  num_stages, num_replicas, routes, order = CASES["random_routing"]
  cfg, _, params_R = _model(num_stages, num_replicas)
  table = ticks.compile_ticks(routes, num_stages, num_replicas, order)
  batch = np.random.default_rng(0).integers(0, 256, (len(routes), MB_SIZE, SEQ + 1))
  executor = PipelineExecutor(stages.StageFunctions(cfg), table)
  ledger = lowcomm_jax.comm.Ledger()
  with ledger.recording():
    executor.compiled_text(stages.to_grid(params_R, num_stages), batch)
  message_bytes = MB_SIZE * SEQ * cfg.d_model * 4  # one float32 activation (or its gradient)
  messages = sum(len(a) + len(g) for a, g in zip(table.permutations("act"),
                                                 table.permutations("grad")))
  assert messages > 0
  assert {e.kind for e in ledger.entries} == {"ppermute"}
  assert ledger.sent_bytes == pytest.approx(messages * message_bytes / table.num_devices, rel=1e-12)


@pytest.mark.parametrize("order,routes_name",
                         [("gpipe", "full"), ("1f1b", "full"), ("gpipe", "random"),
                                               ("1f1b", "random"), ("gpipe", "skippipe")])
def test_planned_idle_ticks_equal_simulator_with_unit_costs(order, routes_name):
  routes, (s, r) = {"full": (routing.full_pipeline_routes(6, 4, 2), (4, 2)),
                    "random": (routing.random_routes(5, 2, 4, seed=1), (2, 4)),
                    "skippipe": (skippipe_routes(), (4, 2))}[routes_name]
  table = ticks.compile_ticks(routes, s, r, order)
  makespan, idle = bubble.simulated_idle_ticks(table, len(routes) if order == "gpipe" else s)
  assert table.num_ticks == makespan
  np.testing.assert_array_equal(table.idle_ticks(), idle)
  # Lock-step permutations never contend for a port; SkipPipe's paths do, here without changing
  # any device's idle ticks.
  assert table.port_waits == (6 if routes_name == "skippipe" else 0)


def test_port_conflicts_can_make_the_plan_differ_from_the_simulator():
  # SkipPipe's paths in 1F1B order: two messages would meet at one device, the later op waits a
  # tick, and the plan (11 ticks) no longer follows the continuous-time simulator (13 ticks), which
  # lets a device receive any number of messages at once.
  table = ticks.compile_ticks(skippipe_routes(), 4, 2, "1f1b")
  makespan, _ = bubble.simulated_idle_ticks(table, 4)
  assert table.port_waits > 0 and (table.num_ticks, makespan) == (11, 13)


def test_full_pipeline_gpipe_bubble_by_hand():
  # One pipeline, S = 2, M = 3, loss on stage 0: stage 0 runs F0 F1 F2 L0 L1 L2 B0 B1 B2 (9 busy
  # ticks, never idle); stage 1 runs F at ticks 1-3 and B at 4-6 (3 idle of 9: ticks 0, 7, 8).
  table = ticks.compile_ticks(routing.full_pipeline_routes(3, 2, 1), 2, 1, "gpipe")
  assert table.num_ticks == 9
  np.testing.assert_array_equal(table.idle_ticks(), [0, 3])
  assert table.text().splitlines()[1] == "s1 r0 | .  F0 F1 F2 B0 B1 B2 .  . "


def _colliding_table():
  # 2 stages × 2 replicas; micro-batches 0 (origin replica 0) and 1 (origin replica 1) both go to
  # replica 0 of stage 1 in tick 0: device 1 would receive two activations at once.
  routes = (routing.Route((0, 1), (0, 0)), routing.Route((0, 1), (1, 0)))
  F, L, B, I = ticks.FORWARD, ticks.LOSS, ticks.BACKWARD, ticks.IDLE
  op = np.array([[F, I, F, I], [I, F, I, I], [L, F, I, I], [I, B, L, I], [B, B, I, I],
                 [I, I, B, I]])
  mb = np.array([[0, -1, 1, -1], [-1, 0, -1, -1], [0, 1, -1, -1], [-1, 0, 1, -1], [0, 1, -1, -1],
                 [-1, -1, 1, -1]])
  send = np.array([[1, -1, 1, -1], [-1, 0, -1, -1], [1, 2, -1, -1], [-1, 0, 1, -1], [-1, 2, -1, -1],
                   [-1, -1, -1, -1]])
  return ticks.TickTable(2, 2, routes, op, mb, send)


def test_two_microbatches_to_one_device_in_one_tick_is_rejected_before_compilation():
  message = (r"at tick 0, device 1 \(stage 1, replica 0\) would receive the activations of "
             r"micro-batches \[0, 1\]")
  with pytest.raises(ValueError, match=message):
    ticks.validate(_colliding_table())
  cfg, _, _ = _model(2, 2)
  with pytest.raises(ValueError, match=message):
    PipelineExecutor(stages.StageFunctions(cfg), _colliding_table())
  # The same table with micro-batch 1 sent to replica 1 of stage 1 instead is accepted.
  fixed = _colliding_table()
  fixed_routes = (fixed.routes[0], routing.Route((0, 1), (1, 1)))
  op, mb, send = fixed.op.copy(), fixed.microbatch.copy(), fixed.send.copy()
  op[:, 3], mb[:, 3], send[:, 3] = op[:, 1], np.where(mb[:, 1] == 1, 1, -1), -1
  op[:, 1] = np.where(mb[:, 1] == 1, ticks.IDLE, op[:, 1])
  mb[:, 1] = np.where(mb[:, 1] == 1, -1, mb[:, 1])
  ticks_with_mb1 = mb[:, 3] == 1
  send[ticks_with_mb1, 3] = 2
  send[:, 1] = np.where(op[:, 1] == ticks.IDLE, -1, send[:, 1])
  send[0, 2], send[3, 2] = 3, 3  # F1 now goes to device 3 and L1 sends its gradient back there
  op[:, 3] = np.where(ticks_with_mb1, op[:, 3], ticks.IDLE)
  ticks.validate(dataclasses.replace(fixed, routes=fixed_routes, op=op, microbatch=mb, send=send))
  # compile_ticks refuses a routing that is not a permutation when asked to keep the simulator's
  # policy.
  with pytest.raises(ValueError, match="micro-batches \\[0, 1\\]"):
    ticks.compile_ticks(_colliding_table().routes, 2, 2, on_collision="raise")


@pytest.mark.parametrize("kwargs,message", [
    (dict(order="zigzag"), "order must be one of \\['gpipe', '1f1b'\\], got 'zigzag'"),
    (dict(memory=0), "memory must be >= 1"),
    (dict(on_collision="drop"), "on_collision must be 'wait' or 'raise'"),
])
def test_bad_compile_options(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ticks.compile_ticks(routing.full_pipeline_routes(2, 2, 1), 2, 1, **kwargs)


def test_bad_routes():
  with pytest.raises(ValueError, match="micro-batch 0 starts at stage 1"):
    ticks.compile_ticks([routing.Route((1, 0), (0, 0))], 2, 1)
  with pytest.raises(ValueError, match="micro-batch 0 uses replicas \\[0, 2\\]"):
    ticks.compile_ticks([routing.Route((0, 1), (0, 2))], 2, 2)


def test_grid_optimizer_noloco_pairs_replicas_within_each_stage():
  # NoLoCo's sync step on the (replica, stage) grid equals the same step under vmap over replicas
  # on whole models: the "replica" collectives inside the grid pair the replicas of each stage.
  num_stages, num_replicas = 2, 4
  cfg, _, params_R = _model(num_stages, num_replicas)
  grads_R = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), params_R)
  tx = lowcomm_jax.noloco(optax.sgd(0.1), num_replicas, sync_every=1, num_groupings=2, seed=5)
  mesh = lowcomm_jax.mesh.make_mesh({"replica": num_replicas, "stage": num_stages})
  per_device = lambda fn, n: jax.jit(sources.PipelineGradients.per_device(
      types.SimpleNamespace(mesh=mesh), fn, n))
  grid = stages.to_grid(params_R, num_stages)
  grid_update = per_device(lambda g, s, p: tx.update(g, s, p, phase=tx.phase_at(1)), 3)
  updates, _ = grid_update(stages.to_grid(grads_R, num_stages), per_device(tx.init, 1)(grid), grid)
  new_grid = optax.apply_updates(grid, updates)

  _, state = tx.init_replicated(jax.tree.map(lambda x: x[0], params_R), num_replicas)
  state = state._replace(slow=params_R)
  phase = tx.phase_at(1)
  step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p, phase=phase),
                          in_axes=(0, tx.state_axes, 0),
                          out_axes=(0, tx.state_axes), axis_name="replica"))
  updates, _ = step(grads_R, state, params_R)
  want = optax.apply_updates(params_R, updates)
  # one outer step: a pair's mean and ≤ 8 elementwise roundings, at each leaf's scale
  testing.assert_trees_within(stages.from_grid(new_grid), want,
                              lambda w: testing.trajectory_error_bound(w, 1, 2 + 8))


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile, from the cache or not


def test_a_pipeline_program_loaded_back_from_the_persistent_cache_runs_as_compiled(tmp_path):
  """The Trainer's pipeline step programs go through the persistent compilation cache (on for the
  test session, tests/conftest.py) like every other: a second run of one config (pipeline permutes
  and NoLoCo's permutes in one program, its sync step included) compiles nothing, every program
  loaded back from the cache, runs, and logs the first run's losses bit for bit."""
  config = testing.engine_config("pipeline_noloco", num_steps=3)
  Trainer(config, tmp_path / "first").run()
  events, compiles = [], []  # JAX's monitoring events: each compile request, each cache hit
  on_event = lambda event, **_: events.append(event)
  on_compile = lambda event, _, **__: compiles.append(event) if event == COMPILE_EVENT else None
  jax.monitoring.register_event_listener(on_event)
  jax.monitoring.register_event_duration_secs_listener(on_compile)
  try:
    Trainer(config, tmp_path / "again").run()
  finally:
    jax.monitoring.unregister_event_listener(on_event)
    jax.monitoring.unregister_event_duration_listener(on_compile)
  assert compiles and events.count("/jax/compilation_cache/cache_hits") == len(compiles), (
      len(compiles), events)
  losses = lambda run: [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("eval_loss"))
                        for r in testing.read_metrics(tmp_path / run)]
  assert losses("again") == losses("first") and len(losses("first")) == 3
