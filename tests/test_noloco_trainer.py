"""NoLoCo in the Trainer: one replica per device equals simulated replicas, HLO, ledger, resume."""

import jax
import numpy as np
import pytest

from lowcomm_jax import codecs, hlo, testing
from lowcomm_jax.testing import collective_bytes, read_metrics, tiny_config
from lowcomm_jax.train import Trainer, validation

M, H = 4, 5


def noloco_config(**changes):
  base = {"algorithm": "noloco", "num_replicas": M, "noloco.sync_every": H, "num_steps": 4 * H,
          "data.batch_size": 4, "data.seq_len": 32, "mesh.data": 1}
  return tiny_config(**{**base, **changes})


def collective_kinds(compiled) -> set:
  return {
    line.split("=")[1].split("(")[0].split()[-1] for line in hlo.collectives(compiled.as_text())
  }


def test_replica_per_device_equals_simulated_replicas_and_logs_spread_and_replica_losses(tmp_path):
  # (b) shard_map over 4 devices, one replica each, against (a) 4 replicas vmapped on one device.
  on_devices = Trainer(noloco_config(**{"mesh.replica": M, "eval.every": H}), tmp_path / "devices",
                       devices=jax.devices()[:M])
  simulated = Trainer(noloco_config(**{"mesh.replica": 1, "eval.every": H}), tmp_path / "one",
                      devices=jax.devices()[:1])
  (a, on_devices_final), (b, simulated_final) = (testing.run_to_end(on_devices),
                                                   testing.run_to_end(simulated))
  # Devices sum the gossip means and gradients in other orders than vmap: within the tiny model's
  # chain-of-sums bound per step (4·H steps), each leaf at its own scale.
  chain = testing.tiny_chain_of_sums(32, 4 * 32)
  testing.assert_trees_within(
    on_devices_final.state,
    simulated_final.state,
    lambda y: testing.trajectory_error_bound(y, 4 * H, chain) if np.size(y) else 0,
  )
  testing.assert_within(a["final_eval_loss_replicas"], b["final_eval_loss_replicas"],
                        testing.trajectory_error_bound(b["final_eval_loss_replicas"], 4 * H, chain))

  # The replicas differ (no global average), and the logged spread is the RMS distance from the
  # mean.
  slow = [np.asarray(x) for x in jax.tree.leaves(on_devices_final.state.opt_state.slow)]
  expected = np.sqrt(sum(((x - x.mean(0)) ** 2).sum() for x in slow) / sum(x.size for x in slow))
  assert expected > 0
  # Sums of n squares in other orders (the program's vs numpy's): within γ_n of Σ squares each, the
  # square root halving that; the mean over M replicas and ≤ 4 elementwise roundings on top.
  n = sum(x.size for x in slow)
  spread_bound = expected * (
    testing.sum_error_bound(1.0, n + M) / 2 + testing.operation_error_bound(1.0, 4)
  )
  testing.assert_within(a["final_weight_spread"], expected, spread_bound, "final spread")
  metrics = read_metrics(tmp_path / "devices")
  assert [m["step"] for m in metrics if "weight_spread" in m] == [H, 2 * H, 3 * H, 4 * H]
  testing.assert_within(metrics[-1]["weight_spread"], expected, spread_bound, "logged spread")
  # Seed 0 pairs {0,2},{1,3} three times, then {1,2},{0,3}: only then do all four replicas differ.
  assert len(set(a["final_eval_loss_replicas"])) == M
  # The mean model's loss is logged next to each replica's.
  assert {"eval_loss", *(f"eval_loss_replica_{i}" for i in range(M))} <= set(metrics[-1])

  # Bytes per worker: each outer step sends φ and Δ (float32) to its one peer.
  syncs, n = 4, on_devices.num_params
  assert a["bytes_sent_per_worker"]["total"] == syncs * 2 * 4 * n
  assert a["bytes_sent_per_worker"]["peak_per_sync"] == 2 * 4 * n


def _pairs(lines) -> set:
  """The (source, target) device pairs of collective-permute lines."""
  pairs = set()
  for line in lines:
    for pair in line.split("source_target_pairs={")[1].split("}}")[0].strip("{}").split("},{"):
      pairs.add(tuple(map(int, pair.split(","))))
  return pairs


def test_one_outer_program_runs_only_its_groupings_permutations(tmp_path):
  groupings = 3
  trainer = Trainer(noloco_config(**{"mesh.replica": M, "noloco.num_groupings": groupings}),
                    tmp_path,
                    devices=jax.devices()[:M])
  state = trainer.init_state()
  local, _ = trainer.program(trainer.algorithm.phase_at(1), state)
  assert collective_kinds(local) == set()
  # Every outer step runs the same program: its grouping is picked inside it, from the step count.
  assert len({trainer.algorithm.phase_at(H * k) for k in range(1, 4 * groupings)}) == 1
  sync, entries = trainer.program(trainer.algorithm.phase_at(H), state)
  text = sync.as_text()
  # No collective runs on every outer step (no all-reduce over the replicas, nor any other): all are
  # inside one conditional with a branch per grouping, each branch exchanging within its groups
  # only.
  assert hlo.collectives_outside_conditionals(text) == []
  [branches] = [b for b in hlo.conditional_branch_collectives(text) if any(b)]
  assert len(branches) == groupings
  for grouping, lines in zip(trainer.algorithm.tx.pool, branches):
    assert {line.split("=")[1].split("(")[0].split()[-1] for line in lines} <= {
        "collective-permute", "collective-permute-start"}
    assert _pairs(lines) == {(int(a), int(b)) for g in grouping for a in g for b in g if a != b}
    # The ledger records the bytes of one branch, which are every branch's.
    assert sum(map(collective_bytes, lines)) == sum(e.payload_bytes for e in entries)
  assert [(e.name, e.sent_bytes) for e in entries] == [
      ("noloco slow weights", 4 * trainer.num_params),
      ("noloco outer gradient", 4 * trainer.num_params)]
  # The virtual clock sees one pairwise exchange of both tensors per outer step, blocking the next
  # step (the last one, after step 3H, holds back the end of the run).
  events = trainer.comm_events(3 * H, state)
  assert [(e.issued_step, e.consumed_step, e.kind, e.num_workers) for e in events] == [
      (s - 1, s, "gossip", 2) for s in (H, H, 2 * H, 2 * H, 3 * H, 3 * H)]
  assert [e.payload_bytes for e in events] == [4 * trainer.num_params] * 6


def test_codec_sends_encoded_outer_gradients(tmp_path):
  trainer = Trainer(noloco_config(**{"noloco.codec": "e3m0", "noloco.codec_block_size": 256}),
                    tmp_path)
  state = trainer.init_state()
  entries = trainer.phase_entries(trainer.algorithm.phase_at(H), state)
  codec = codecs.get_codec("e3m0", 256)
  wire = sum(codec.wire_bytes(x.size) for x in jax.tree.leaves(trainer.init_params()))
  assert [e.sent_bytes for e in entries] == [4 * trainer.num_params, wire]
  assert wire < 4 * trainer.num_params / 6  # 4 bits and a scale per 256 values


@pytest.mark.parametrize("changes,message", [
    ({"noloco.group_size": 3},
     "noloco.group_size must be >= 2 and a divisor of num_replicas=4, got 3"),
    ({"noloco.group_size": 1}, "noloco.group_size must be >= 2"),
    ({"mesh.replica": 2}, "mesh.replica must be 1 .* or num_replicas=4"),
    ({"num_replicas": 1, "noloco.group_size": 1}, "num_replicas must be >= 2 for algorithm=noloco"),
    ({"noloco.codec": "fp3"}, "noloco.codec must be none or one of"),
])
def test_bad_input_is_named_before_anything_is_written(tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    Trainer(noloco_config(**changes), tmp_path / "run")
  assert not (tmp_path / "run").exists()
  validation.validate(noloco_config())  # the base config itself is valid
