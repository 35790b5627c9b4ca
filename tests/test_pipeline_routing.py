"""NoLoCo's random routing: a permutation at every boundary, reproducible from the seed, fixed at
eval."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lowcomm_jax.parallel import routing, ticks


def test_random_routing_is_a_permutation_at_every_boundary_and_slot():
  table = routing.random_replica_table(num_slots=20, num_stages=4, num_replicas=4, seed=7)
  for k in range(20):
    np.testing.assert_array_equal(table[k, 0], np.arange(4))  # every replica starts its own
    for s in range(4):
      # every replica of stage s receives exactly one micro-batch of slot k
      np.testing.assert_array_equal(np.sort(table[k, s]), np.arange(4))
    for s in range(3):
      perm = routing.boundary_permutation(7, k, s, 4, 4)
      np.testing.assert_array_equal(table[k, s + 1], perm[table[k, s]])
  # it does mix: across slots, replica 0's micro-batch reaches every replica of the last stage
  assert set(table[:, 3, 0].tolist()) == {0, 1, 2, 3}


def test_random_routing_is_identical_for_the_same_seed_and_differs_for_another():
  a = routing.random_replica_table(8, 3, 4, seed=1)
  np.testing.assert_array_equal(a, routing.random_replica_table(8, 3, 4, seed=1))
  assert not np.array_equal(a, routing.random_replica_table(8, 3, 4, seed=2))
  # the slot counter is global: slots 4..7 of one draw are slots 0..3 of a draw starting at 4
  np.testing.assert_array_equal(a[4:], routing.random_replica_table(4, 3, 4, seed=1, first_slot=4))


def test_fixed_routing_at_evaluation_keeps_each_replica():
  routes = routing.full_pipeline_routes(2, 3, 4)
  assert [r.replicas for r in routes[:4]] == [(0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 3)]
  assert all(r.stages == (0, 1, 2) for r in routes)


def test_random_routing_ticks_receive_one_microbatch_per_device_per_tick():
  table = ticks.compile_ticks(routing.random_routes(6, 3, 4, seed=0), 3, 4, on_collision="raise")
  received = table.received("act")
  for t in range(table.num_ticks):
    # lock step: in a tick, the replicas of a receiving stage each get one micro-batch, all of one
    # slot
    for s in range(3):
      got = received[t, [r * 3 + s for r in range(4)]]
      assert (got >= 0).all() or (got < 0).all()
      if (got >= 0).all():
        assert len(set((got // 4).tolist())) == 1 and sorted((got % 4).tolist()) == [0, 1, 2, 3]


def test_bad_sizes():
  with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
    routing.random_replica_table(2, 2, 0, seed=0)


def _run_pipeline_binary(*flags):
  root = pathlib.Path(__file__).resolve().parents[1]
  return subprocess.run(
      [sys.executable, str(root / "experiments" / "train.py"),
       f"--config={root / 'experiments' / 'configs' / 'noloco_pipeline.py'}:quick", *flags],
      capture_output=True, text=True, timeout=120,
      env=dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8"))


@pytest.mark.processes  # starts a binary: not in the fast tier
def test_pipeline_binary_refuses_bad_input_and_an_existing_run_before_writing(tmp_path):
  bad = _run_pipeline_binary(f"--workdir={tmp_path / 'new'}", "--config.pipeline.routing=bogus")
  assert bad.returncode != 0 and "pipeline.routing must be" in bad.stderr
  assert not (tmp_path / "new").exists()
  earlier = tmp_path / "earlier"
  earlier.mkdir()
  (earlier / "config.json").write_text("{}")
  (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
  rerun = _run_pipeline_binary(f"--workdir={earlier}")
  assert rerun.returncode != 0 and f"workdir {earlier} has a config.json" in rerun.stderr
  assert (earlier / "metrics.jsonl").read_text() == '{"step": 1}\n'
  assert sorted(p.name for p in earlier.iterdir()) == ["config.json", "metrics.jsonl"]
