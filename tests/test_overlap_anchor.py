"""outer.overlap_anchor on the phase table: which step sends a fragment and which merges it.

"send" (the paper's): Δ after the nominal sync step n, all-reduce issued with step n + 1, merged
after step n + τ. "apply" (torchft's): Δ after step n − τ, issued with step n − τ + 1, merged after
step n. The golden tables below are written out by hand from that definition.
"""

import pytest

from lowcomm_jax import config as config_lib
from lowcomm_jax.optim import schedule as schedule_lib
from lowcomm_jax.train import validation


def _events(schedule, num_steps):
  """{fragment: ([steps whose program issues its all-reduce], [steps after which it merges])}."""
  events = {p: ([], []) for p in range(schedule.num_fragments)}
  for step in range(1, num_steps + 1):
    phase = schedule_lib.phase_at(schedule, step)
    for p in phase.send:
      events[p][0].append(step)
    for p in phase.receive:
      events[p][1].append(step)
  return events


def test_golden_send_and_merge_steps_h8_p2_tau2():
  # Nominal sync steps: fragment 0 at 4, 12, 20; fragment 1 at 8, 16, 24.
  send = schedule_lib.make_schedule(2, 8, overlap_steps=2, overlap_anchor="send")
  apply = schedule_lib.make_schedule(2, 8, overlap_steps=2, overlap_anchor="apply")
  assert _events(send, 24) == {0: ([5, 13, 21], [6, 14, 22]), 1: ([9, 17], [10, 18])}
  assert _events(apply, 24) == {0: ([3, 11, 19], [4, 12, 20]), 1: ([7, 15, 23], [8, 16, 24])}
  assert send.offset.tolist() == [4, 8] and apply.offset.tolist() == [2, 6]


@pytest.mark.parametrize("num_fragments,sync_every,tau,staggered",
                         [(2, 8, 1, True), (2, 8, 3, True), (4, 12, 2, True), (1, 6, 5, True),
                          (3, 6, 4, False)])
def test_apply_is_send_moved_tau_steps_earlier(num_fragments, sync_every, tau, staggered):
  send = schedule_lib.make_schedule(num_fragments, sync_every, tau, 0.5, staggered, "send")
  apply = schedule_lib.make_schedule(num_fragments, sync_every, tau, 0.5, staggered, "apply")
  num_steps = 4 * sync_every
  for step in range(1, num_steps):
    assert schedule_lib.phase_at(apply, step) == schedule_lib.phase_at(send, step + tau), step
  # Every merge of "apply" falls on a nominal sync step (offsets of the send table).
  for p, (_, merges) in _events(apply, num_steps).items():
    assert merges and all((m - send.offset[p]) % sync_every == 0 for m in merges)
  # The phase table (one compiled program per distinct phase) covers every step the same way.
  phases, table, s0 = schedule_lib.phase_table(apply)
  for step in range(1, num_steps):
    index = step if step < s0 else s0 + (step - s0) % sync_every
    assert phases[table[index - 1]] == schedule_lib.phase_at(apply, step)


def test_without_overlap_both_anchors_are_the_same_schedule():
  for staggered in (True, False):
    send = schedule_lib.make_schedule(3, 9, 0, 0.0, staggered, "send")
    apply = schedule_lib.make_schedule(3, 9, 0, 0.0, staggered, "apply")
    assert all((a == b).all() for a, b in zip(send, apply))


def test_bad_anchor_is_refused_naming_the_option():
  with pytest.raises(ValueError, match=r"outer.overlap_anchor must be one of \('send', 'apply'\)"):
    schedule_lib.make_schedule(2, 8, 1, overlap_anchor="before")
  c = config_lib.override(config_lib.default_config(), {
      "algorithm": "streaming_diloco", "num_replicas": 2, "outer.sync_every": 8,
      "outer.num_fragments": 2, "outer.non_block_fragment": "fold", "outer.overlap_steps": 1,
      "outer.overlap_anchor": "torchft"})
  with pytest.raises(ValueError, match=r"outer.overlap_anchor must be one of"):
    validation.validate(c)
  c.outer.overlap_anchor = "apply"
  validation.validate(c)  # accepted


def test_config_reaches_the_optimizer_schedule():
  from lowcomm_jax.train import algorithms  # pylint: disable=g-import-not-at-top
  c = config_lib.override(config_lib.default_config(), {
      "algorithm": "streaming_diloco", "num_replicas": 2, "outer.sync_every": 8,
      "outer.num_fragments": 2, "outer.non_block_fragment": "fold", "outer.overlap_steps": 2,
      "outer.overlap_anchor": "apply", "outer.codec": "e3m0", "outer.codec_kernels": "pallas"})
  validation.validate(c)
  tx = algorithms.make_algorithm(c, 2).tx
  assert _events(tx.schedule, 24) == {0: ([3, 11, 19], [4, 12, 20]), 1: ([7, 15, 23], [8, 16, 24])}
  assert tx.codec_kernels == "pallas"
