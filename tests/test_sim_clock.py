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


def test_deadline_order_serves_the_transfer_needed_first():
  # Step 0 (0.9 s) issues three 1 s transfers, ready at 0.5, 0.7 and 0.9 and
  # needed 0.2, 0.1 and 0 s into step 1 (layers 2, 1, 0 of a 3-layer model).
  # The first holds the link 0.5-1.5; then both others wait. FIFO serves the
  # one issued first (1.5-2.5, then 2.5-3.5): step 1 waits for 3.5 - 0 = 3.5.
  # Deadline serves the one needed first (1.5-2.5, then 2.5-3.5 for the one
  # needed at 0.1): step 1 may start at max(2.5 - 0, 3.5 - 0.1) = 3.4.
  transfers = [clock.Transfer(0, 1, 1.0, 0.5, 0.2), clock.Transfer(0, 1, 1.0, 0.7, 0.1),
               clock.Transfer(0, 1, 1.0, 0.9, 0.0)]
  fifo = clock.run_timeline(0.9, transfers, 2, order="fifo")
  deadline = clock.run_timeline(0.9, transfers, 2, order="deadline")
  assert fifo.step_start == [0.0, 3.5, 4.4]
  assert deadline.step_start == pytest.approx([0.0, 3.4, 4.3])
  assert deadline.comm_seconds == fifo.comm_seconds == 3.0


def test_deadline_order_across_steps():
  # Steps of 2 s. A 3 s sync issued at step 0 may overlap until step 3; a 1 s
  # one issued at step 1 blocks step 2. The first holds the link 2-5 and is
  # never interrupted, so the second runs 5-6 and step 2 starts at 6, in
  # either order.
  late = [clock.Transfer(0, 3, 3.0), clock.Transfer(1, 2, 1.0)]
  for order in clock.LINK_ORDERS:
    assert clock.run_timeline(2.0, late, 4, order=order).step_start[2] == 6.0
  # Both issued at step 0, ready at 2 together: FIFO sends the first given
  # (the long one, 2-5, then the short one 5-6: step 1 at 6, step 3 at 10);
  # deadline sends the one step 1 needs (2-3, then 3-6: step 1 at 3, steps
  # 2 and 3 at 5 and 7).
  both = [clock.Transfer(0, 3, 3.0), clock.Transfer(0, 1, 1.0)]
  assert clock.run_timeline(2.0, both, 4, order="fifo").step_start == [0, 6, 8, 10, 12]
  assert clock.run_timeline(2.0, both, 4, order="deadline").step_start == [0, 3, 5, 7, 9]


def test_bad_events():
  with pytest.raises(ValueError, match="consumed_step"):
    clock.simulate_run(1.0, [(2, 2, 1.0, "all_reduce", 2)], NET, num_steps=3)
  with pytest.raises(ValueError, match="issued_step"):
    clock.simulate_run(1.0, [(3, 4, 1.0, "all_reduce", 2)], NET, num_steps=3)
  with pytest.raises(ValueError, match="kind"):
    clock.simulate_run(1.0, [(0, 1, 1.0, "broadcast", 2)], NET, num_steps=3)
  with pytest.raises(ValueError, match="num_steps"):
    clock.simulate_run(1.0, [], NET)
  with pytest.raises(ValueError, match="order"):
    clock.run_timeline(1.0, [], 2, order="lifo")
  with pytest.raises(ValueError, match="deadline"):  # issued before it has used what it consumes
    clock.run_timeline(1.0, [clock.Transfer(0, 1, 1.0, 0.2, 0.5),
                             clock.Transfer(1, 2, 1.0, 0.1)], 3, order="deadline")
