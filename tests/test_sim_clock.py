"""The virtual clock against sums worked out by hand."""

import pytest

from lowcomm_jax.sim import clock, network as net_lib

# 1 Gbit/s, no latency: an all-reduce of S bytes between 2 workers (ring
# factor 2(M-1)/M = 1) takes 8S / 1e9 seconds, so 125e6 bytes take 1 s.
NET = net_lib.Network(1e9, 0.0)
ONE_SECOND = 125e6


def test_no_events_is_pure_compute():
  timeline = clock.simulate_run([1.0, 2.0, 3.0], [], NET)
  assert timeline.wall_seconds == 6.0
  assert timeline.compute_utilization == 1.0
  assert timeline.step_start == [0.0, 1.0, 3.0, 6.0]


def test_blocking():
  # Step 0 computes 0-2, the all-reduce runs 2-3, step 1 waits until 3.
  timeline = clock.simulate_run(2.0, [(0, 1, ONE_SECOND, "all_reduce", 2)], NET, num_steps=3)
  assert timeline.step_start == [0.0, 3.0, 5.0, 7.0]
  assert timeline.stall_seconds == [0.0, 1.0, 0.0]
  assert timeline.wall_seconds == 7.0
  assert timeline.comm_seconds == pytest.approx(1.0)


def test_overlapped_and_hidden():
  # tau = 1: consumed at step 2; it finishes at 3, before step 1 ends at 4.
  timeline = clock.simulate_run(2.0, [(0, 2, ONE_SECOND, "all_reduce", 2)], NET, num_steps=3)
  assert timeline.stall_seconds == [0.0, 0.0, 0.0]
  assert timeline.wall_seconds == 6.0


def test_overlapped_but_too_slow():
  # 3 s of communication from 2 to 5; step 1 ends at 4; step 2 waits 1 s.
  timeline = clock.simulate_run(2.0, [(0, 2, 3 * ONE_SECOND, "all_reduce", 2)], NET, num_steps=3)
  assert timeline.step_start == [0.0, 2.0, 5.0, 7.0]
  assert timeline.stall_seconds == [0.0, 0.0, 1.0]
  assert timeline.wall_seconds == 7.0
  assert timeline.compute_utilization == pytest.approx(6.0 / 7.0)


def test_fifo_queueing():
  # Two 3 s syncs issued after steps 0 and 1, each consumed one step later
  # than blocking. The first holds the link 2-5; the second is ready at 4 but
  # queues until 5 and runs 5-8. Step 2 starts at 5 (ends 7), step 3 at 8.
  events = [clock.CommEvent(0, 2, 3 * ONE_SECOND, "all_reduce", 2),
            clock.CommEvent(1, 3, 3 * ONE_SECOND, "all_reduce", 2)]
  timeline = clock.simulate_run(2.0, events, NET, num_steps=4)
  assert timeline.step_start == [0.0, 2.0, 5.0, 8.0, 10.0]
  assert timeline.stall_seconds == [0.0, 0.0, 1.0, 1.0]
  assert timeline.wall_seconds == 10.0


def test_run_ends_when_the_last_sync_has_finished():
  # Issued after the last step, consumed "after the end": the run still waits.
  timeline = clock.simulate_run(2.0, [(1, 5, ONE_SECOND, "all_reduce", 2)], NET, num_steps=2)
  assert timeline.step_end[-1] == 4.0
  assert timeline.wall_seconds == 5.0


def test_kinds_latency_and_per_step_times():
  # Internet preset: 1 Gbit/s, 50 ms. A gossip pair (one message: 1 s + 50 ms)
  # blocking after step 0, then a 4-worker ring all-reduce (1.5 s + 6 * 50 ms)
  # blocking after step 1. Steps take 1 s, 2 s, 1 s.
  events = [(0, 1, ONE_SECOND, "gossip", 2), (1, 2, ONE_SECOND, "all_reduce", 4)]
  timeline = clock.simulate_run([1.0, 2.0, 1.0], events, "internet")
  expected = 1.0 + 1.05 + 2.0 + 1.8 + 1.0
  assert timeline.wall_seconds == pytest.approx(expected)
  assert timeline.compute_seconds == 4.0


def test_per_layer_transfers_with_ready_and_needed_times():
  # The engine under the utilization simulator: a 1 s transfer ready 0.5 s
  # into step 0 (of 2 s), needed 0.25 s into step 1. It finishes at 1.5, so
  # step 1 starts at 2 without waiting; with a 2 s transfer (ends 2.5) step 1
  # may start at 2.5 - 0.25 = 2.25.
  fast = clock.run_timeline(2.0, [clock.Transfer(0, 1, 1.0, 0.5, 0.25)], 2)
  slow = clock.run_timeline(2.0, [clock.Transfer(0, 1, 2.0, 0.5, 0.25)], 2)
  assert fast.step_start[1] == 2.0
  assert slow.step_start[1] == pytest.approx(2.25)


def test_bad_events():
  with pytest.raises(ValueError, match="consumed_step"):
    clock.simulate_run(1.0, [(2, 2, 1.0, "all_reduce", 2)], NET, num_steps=3)
  with pytest.raises(ValueError, match="issued_step"):
    clock.simulate_run(1.0, [(3, 4, 1.0, "all_reduce", 2)], NET, num_steps=3)
  with pytest.raises(ValueError, match="kind"):
    clock.simulate_run(1.0, [(0, 1, 1.0, "broadcast", 2)], NET, num_steps=3)
  with pytest.raises(ValueError, match="num_steps"):
    clock.simulate_run(1.0, [], NET)
