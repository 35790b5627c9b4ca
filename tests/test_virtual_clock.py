"""The virtual clock of a real run: the ledger's bytes and the algorithm's overlap, priced on a
network."""

import jax
import pytest

from lowcomm_jax import config as config_lib
from lowcomm_jax.testing import engine_config, streaming_config, tiny_config
from lowcomm_jax.train import Trainer

BANDWIDTH, LATENCY = 100e6, 0.030  # "100Mbit,30ms"


def ring_seconds(payload_bytes, m=2):
  """2(M−1)/M · 8S/B + 2(M−1)·ℓ, written out again here on purpose."""
  return 2 * (m - 1) / m * 8 * payload_bytes / BANDWIDTH + 2 * (m - 1) * LATENCY


def test_diloco_run_wall_time_equals_the_hand_sum(tmp_path):
  c = tiny_config(algorithm="diloco", num_replicas=2, num_steps=8, network="100Mbit,30ms",
                  **{"outer.sync_every": 4, "hardware.step_seconds": 0.5})
  trainer = Trainer(c, tmp_path)
  summary = trainer.run()
  # Two blocking syncs of every float32 parameter (after steps 4 and 8): 8 steps of compute plus two
  # all-reduces, nothing overlapped.
  expected = 8 * 0.5 + 2 * ring_seconds(4 * trainer.num_params)
  assert summary["simulated_wall_time_s"] == pytest.approx(expected, rel=1e-9)
  assert summary["network"] == "100Mbit,30ms"
  # replicas of the declared speeds 1 and 1/4: every step waits for the slower one
  config_lib.override(c, {"elastic.speeds": "1,0.25"})
  summary = Trainer(c, tmp_path / "speeds").run()
  assert summary["simulated_step_seconds"] == 4 * 0.5
  assert summary["simulated_wall_time_s"] == pytest.approx(
      8 * 4 * 0.5 + 2 * ring_seconds(4 * trainer.num_params), rel=1e-9)


def test_streaming_overlap_hides_what_fits_and_stalls_for_the_rest(tmp_path):
  c = streaming_config(num_steps=12, network="100Mbit,30ms")  # H = 6, 3 fragments, τ = 1
  trainer = Trainer(c, tmp_path)
  state = trainer.init_state()
  params = jax.tree.map(lambda x: x[0], state.params)
  seconds = [
    ring_seconds(4 * f.num_elements(params)) for f in trainer.algorithm.tx.fragments(params)
  ]
  events = trainer.comm_events(12, state)
  # Fragments 0, 1, 2, 0, 1 are sent in steps 3, 5, 7, 9, 11 (from the parameters entering them),
  # each ready when the step before ends and needed one step later.
  assert [(e.issued_step, e.consumed_step) for e in events] == [(1, 3), (3, 5), (5, 7), (7, 9),
                                                                (9, 11)]
  # Slow compute: every transfer hides under one step.
  slow = max(seconds) * 1.01
  assert trainer.simulated_wall_time(12, slow, state) == pytest.approx(12 * slow, rel=1e-9)
  # Fast compute: each transfer stalls the step that needs it by what one step did not hide.
  fast = 1e-3
  stalls = sum(seconds[p] - fast for p in (0, 1, 2, 0, 1))
  assert trainer.simulated_wall_time(12, fast, state) == pytest.approx(12 * fast + stalls, rel=1e-9)


def test_bad_network_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"network"):
    Trainer(tiny_config(network="fast please"), tmp_path / "w")
  assert not (tmp_path / "w").exists()


def test_the_pipelines_stage_to_stage_messages_are_on_the_clock(tmp_path):
  """NoLoCo over a 2-stage pipeline (2 replicas, 2 slots, gpipe; lowcomm_jax.testing's
  pipeline_noloco): every step has 6 ticks; ticks 0-2 send activations and ticks 2-4 gradients
  to the other stage, 6 blocking messages of one micro-batch's [2, 32, 32] float32 = 8192 bytes
  each. NoLoCo's gossip after steps 3 and 6 sends the slow weights and the outer gradient (106,880
  bytes each) to the pair's other replica; the one after the last step holds back the end of the
  run, as DiLoCo's last all-reduce does. Without the pipeline's messages the clock says 3.1542016
  s."""
  trainer = Trainer(engine_config("pipeline_noloco", network="100Mbit,30ms"), tmp_path)
  state = trainer.init_state()
  events = trainer.comm_events(6, state)
  sends = [e for e in events if e.kind == "send"]
  assert len(sends) == 6 * 6 and {e.payload_bytes for e in sends} == {8192}
  assert {(e.issued_step, e.consumed_step) for e in sends} == {(s, s + 1) for s in range(6)}
  message = LATENCY + 8 * 8192 / BANDWIDTH  # ℓ + 8S/B, one after the other within a step
  gossip = LATENCY + 8 * 106880 / BANDWIDTH
  assert trainer.simulated_wall_time(6, 0.5, state) == pytest.approx(
      6 * 0.5 + 36 * message + 4 * gossip, rel=1e-12)
  assert 6 * 0.5 + 36 * message + 4 * gossip == pytest.approx(4.25779456, rel=1e-12)
