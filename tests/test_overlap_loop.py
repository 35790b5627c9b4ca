"""The Trainer with `outer.overlap_executor=thread` (lowcomm_jax.train.overlap) equals the inline
loop: Streaming DiLoCo (P = 2, H = 6, α = 0.5, 8 steps) for τ = 1 and τ = 2, in one process
(vmapped replicas), on the 8-device mesh and on two processes (jax.distributed, gloo; also with the
e3m0 codec and error feedback at τ = 2); SparseLoCo on the same schedule (its sparse gather and
error buffers on the thread) at τ = 1 on the mesh (vmapped: tests/test_sparseloco.py); its training
thread's programs hold no cross-replica collective; a resume with a fragment in flight is
bit-identical.

Tolerance `testing.trajectory_error_bound` per leaf of the parameters and state: with the thread the
merge step's program runs its inner step only and a program of its own applies the outer step and
the merge once the mean arrived (so the step's compute overlaps the all-reduce); inline the merge is
fused into the step (with the inner update, the step's θ + (merged − θ) and at τ = 1 the mean's 1/M
scaling), so the two round differently at the ulp scale. Measured: τ = 1 7.5e-9 (vmap) and 3.0e-8
(mesh), τ = 2 3.7e-9 and 7.5e-9; SparseLoCo τ = 1 on the mesh 7.5e-9. A resume with a fragment in
flight merges through the same merge program: bit-identical to the uninterrupted thread run.
"""

import re

import jax
import numpy as np
import pytest

from lowcomm_jax import hlo, testing
from lowcomm_jax.optim.schedule import Phase
from lowcomm_jax.train import Trainer, hooks, overlap

CASE = {**testing.ENGINE_CASES["streaming_diloco"]["config"],
        "num_steps": 8, "outer.sync_every": 6, "data.seq_len": 32, "data.batch_size": 4,
        "eval.batch_size": 4, "eval.num_batches": 1, "log_every": 4, "optimizer.warmup_steps": 2}
# |thread − inline| per leaf: each of the 8 steps may round differently in the mean over M ≤ 4
# replicas and the merge's ≤ 4 elementwise ops (1/M, θ + (merged − θ), the outer step), at the
# leaf's scale: trajectory_error_bound(leaf, 8, 4 + 4)
NUM_STEPS, TERMS_PER_STEP = CASE["num_steps"], 4 + 4
# Fragment 0: Δ after step 3, issued with step 4; fragment 1: after step 6, issued with step 7.
ISSUED = [(4, 0), (7, 1)]
LAYOUTS = {"vmap": ({"num_replicas": 2, "mesh.replica": 1, "mesh.data": 1}, 1),
           "mesh": ({"num_replicas": 4, "mesh.replica": 4, "mesh.data": 2}, 8)}
# The algorithm's own schedule keys (the same P, H, α as CASE's) and its section's τ key. SparseLoCo
# keeps 4 of every 64 values at 2 bits (testing.ENGINE_CASES' sparseloco).
ALGORITHMS = {
    "streaming_diloco": ({}, "outer.overlap_steps"),
    "sparseloco": ({"algorithm": "sparseloco", "outer.num_fragments": 2,
                    "outer.sync_every": 6, "outer.merge_alpha": 0.5,
                    "sparseloco.chunk_size": 64, "sparseloco.top_k": 4},
                   "outer.overlap_steps"),
}

_runs: dict = {}


def _run(tmp_path_factory, layout, tau, mode, algorithm="streaming_diloco", **changes):
  """(the Trainer, its final state and its executor timeline: `hooks.FinalState`,
  `hooks.CommTimeline`) of a finished run, trained once per test module."""
  key = (layout, tau, mode, algorithm, tuple(sorted(changes.items())))
  if key not in _runs:
    layout_changes, num_devices = LAYOUTS[layout]
    algorithm_changes, tau_key = ALGORITHMS[algorithm]
    config = testing.tiny_config(**{**CASE, **layout_changes, **algorithm_changes, tau_key: tau,
                                    "outer.overlap_executor": mode, **changes})
    trainer = Trainer(config, tmp_path_factory.mktemp(f"{layout}{tau}{mode}{algorithm}") / "run",
                      devices=jax.devices()[:num_devices])
    final, timeline = hooks.FinalState(), hooks.CommTimeline()
    trainer.run(hooks=[final, timeline])
    _runs[key] = trainer, final, timeline
  return _runs[key]


def _assert_close(a, b, exact: bool = False):
  """Leaves of `b` equal to `a`'s: bit for bit, or within the float32 bound of a trajectory."""
  print(f"max abs diff {testing.max_abs_diff(a, b):.3g}")
  if exact:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  else:
    testing.assert_states_within(b, a, NUM_STEPS, TERMS_PER_STEP)


# Streaming DiLoCo at τ = 2 on each layout (the runs the tests below read too), SparseLoCo at τ = 1
# on the mesh; Streaming DiLoCo at τ = 1 on the thread is test_engine.py's two-process case.
@pytest.mark.parametrize("layout,tau,algorithm", [
    ("vmap", 2, "streaming_diloco"), ("mesh", 2, "streaming_diloco"), ("mesh", 1, "sparseloco")])
def test_thread_equals_inline(tmp_path_factory, layout, tau, algorithm):
  inline, inline_end, inline_comm = _run(tmp_path_factory, layout, tau, "inline", algorithm)
  threaded, threaded_end, threaded_comm = _run(tmp_path_factory, layout, tau, "thread", algorithm)
  assert inline.config.algorithm == algorithm
  assert (inline.overlap_executor, threaded.overlap_executor) == ("inline", "thread")
  assert [(i.step, int(i.name.split()[-1])) for i in threaded_comm.issued] == ISSUED
  assert inline_comm.issued == []
  _assert_close(inline_end.state, threaded_end.state)
  # Not vacuous: the replicas trained apart and both outer steps moved φ.
  params, outer = inline_end.state.params, inline_end.state.opt_state.outer_params
  assert all(
    not np.array_equal(np.asarray(x[0]), np.asarray(x[1])) for x in jax.tree.leaves(params)
  )
  assert inline_end.state.opt_state.nonfinite.tolist() == [0, 0]
  start = inline.init_params()
  assert all(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(outer), jax.tree.leaves(start)))


def _cross_replica(line: str, replica_of) -> bool:
  """Whether an HLO collective's device groups span two replica slots."""
  match = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
  if match:
    groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}",
                                                                      match.group(1))]
  else:  # iota form: replica_groups=[G,S]<=[dims]T(perm)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    assert iota, line
    ids = np.arange(int(np.prod([int(d) for d in iota.group(3).split(",")])))
    ids = ids.reshape([int(d) for d in iota.group(3).split(",")])
    if iota.group(4):
      ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
    groups = ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
  return any(len({replica_of[d] for d in group}) > 1 for group in groups)


def test_thread_step_programs_hold_no_cross_replica_collective(tmp_path_factory):
  """Every program the thread run's training thread compiled on the 8-device mesh (replica 4 ×
  data 2) keeps its collectives inside a replica slot (the data axis's gradient all-reduce): the
  step programs (at τ = 2 the send and merge steps run the non-sync step's program) and the merge
  programs that apply each fragment's mean once it arrived; the inline run's send step
  all-reduces across slots."""
  threaded, threaded_end, _ = _run(tmp_path_factory, "mesh", 2, "thread")
  inline, _, _ = _run(tmp_path_factory, "mesh", 2, "inline")
  replica_of = {i: i // 2 for i in range(8)}  # logical device i sits in slot i // data
  assert threaded.mesh.devices.shape[:2] == (4, 2)

  def crossing(trainer):
    found = {}
    for (phase, _), (compiled, _) in trainer._programs.items():  # pylint: disable=protected-access
      lines = [l for l in compiled.as_text().splitlines()
               if any(f" {op}(" in l for op in hlo.COLLECTIVE_OPS)]
      found[phase] = sum(_cross_replica(l, replica_of) for l in lines)
    return found

  threaded_found, inline_found = crossing(threaded), crossing(inline)
  assert list(threaded_found) == [Phase((), ())] and not any(threaded_found.values()), (
    threaded_found
  )
  state = threaded_end.state
  merges = overlap.Threaded(threaded.algorithm.tx, threaded.mesh)
  try:
    for p in (0, 1):
      phase, due = Phase((), (p,)), (f"fragment {p}",)
      text = (
        merges._apply_program(phase, due, state)
        .lower(state.params, state.opt_state)
        .compile()
        .as_text()
      )  # pylint: disable=protected-access
      assert "fusion" in text and not any(f" {op}(" in text for op in hlo.COLLECTIVE_OPS), due
  finally:
    merges.close()
  send_phases = [ph for ph in inline_found if ph.send]
  assert send_phases and all(inline_found[ph] >= 1 for ph in send_phases), inline_found


def test_thread_leaves_the_non_sync_step_program_unchanged(tmp_path_factory):
  """With no fragment in flight the step lowers to the same module under both executors (the
  module's name aside): a non-sync step costs the same; the thread adds work only on send and merge
  steps. The lowered modules are compared, not the compiled text: an executable loaded from the
  persistent compilation cache prints otherwise than one compiled in this process."""
  trainers = {mode: _run(tmp_path_factory, "mesh", 2, mode)[0] for mode in ("thread", "inline")}
  phases = {mode: {phase for phase, _ in t._programs} for mode, t in trainers.items()}  # pylint: disable=protected-access
  quiet = [ph for ph in phases["thread"] if not ph.send and not ph.receive]
  assert len(quiet) == 1 and quiet[0] in phases["inline"]
  thread_hlo, inline_hlo = (
      re.sub(r"^module @\S+", "", t.lower(quiet[0], t.abstract_state()).as_text()).splitlines()
      for t in (trainers["thread"], trainers["inline"]))
  assert len(thread_hlo) > 100 and thread_hlo == inline_hlo


def test_resume_with_a_fragment_in_flight_is_bit_identical(tmp_path_factory):
  """Stopped after step 4 (fragment 0 issued with step 4, merged after step 5 at τ = 2) and
  resumed: the checkpoint holds the in-flight mean (the loop settles the future into the state's
  in-flight buffer before saving), the resumed loop merges it without a future."""
  whole, whole_end, _ = _run(tmp_path_factory, "vmap", 2, "thread")
  config = testing.tiny_config(**{**CASE, **LAYOUTS["vmap"][0], "outer.overlap_steps": 2,
                                  "outer.overlap_executor": "thread", "stop_at_step": 4})
  workdir = tmp_path_factory.mktemp("resume") / "run"
  first = Trainer(config, workdir, devices=jax.devices()[:1])
  first_end, first_comm = hooks.FinalState(), hooks.CommTimeline()
  first.run(hooks=[first_end, first_comm])
  in_flight = first_end.state.opt_state.comm.in_flight["fragment 0"]
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(in_flight))
  assert [(i.step, int(i.name.split()[-1])) for i in first_comm.issued] == [(4, 0)]
  config.stop_at_step = -1
  second = Trainer(config, workdir, devices=jax.devices()[:1])
  second_end, second_comm = hooks.FinalState(), hooks.CommTimeline()
  second.run(hooks=[second_end, second_comm])
  assert [(i.step, int(i.name.split()[-1])) for i in second_comm.issued] == [(7, 1)]
  _assert_close(whole_end.state, second_end.state, exact=True)


@pytest.fixture(scope="module")
def process_runs(tmp_path_factory):
  """The run directories of testing.overlap_leg_configs(): one launch of two processes (one
  replica each, gloo) trains every run in turn (the processes start and join once)."""
  out = tmp_path_factory.mktemp("processes")
  proc = testing.launch_script(2, [f"--out={out}", "--leg=overlap"],
                               script=testing.ROOT / "tests" / "engine_processes_worker.py")
  assert proc.returncode == 0, proc.stderr[-3000:]
  reported = re.findall(r"(\S+): done, overlap executor (\w+)", proc.stdout)  # by both processes
  expected = [(f"{run}-{mode}", mode) for run in testing.OVERLAP_PROCESS_RUNS
              for mode in testing.OVERLAP_EXECUTORS]
  assert sorted(reported) == sorted(2 * expected), proc.stdout[-3000:]
  return out


@pytest.mark.slow  # two 2-process runs in one launch: 1-5 min on a shared 2-core machine
@pytest.mark.parametrize("run", list(testing.OVERLAP_PROCESS_RUNS))
def test_two_processes_thread_equals_inline(process_runs, run):
  """Two processes (one replica each, gloo): the thread run equals the inline run (measured max abs
  diff: e3m0 with error feedback at τ = 2 1.2e-7, within the bound above). Inline, one replica per
  process runs the step under shard_map: the case also checks that the compressed mean leaves it
  replicated (the in-flight buffer). Plain τ = 2 is left to the vmap and mesh cases above, τ = 1 on
  the thread across two processes to test_engine.py's two-process leg."""
  codec = testing.OVERLAP_PROCESS_RUNS[run][1]
  states = {mode: testing.restored(process_runs / f"{run}-{mode}")
            for mode in testing.OVERLAP_EXECUTORS}
  print(f"two processes, {run}:", end=" ")
  _assert_close(states["inline"], states["thread"])
  if codec:  # not vacuous: the residuals the thread wrote back are the inline ones, and not zero
    residuals = jax.tree.leaves(states["thread"].opt_state.comm.residuals)
    assert residuals and any(np.any(np.asarray(r) != 0) for r in residuals)


def test_overlap_executor_is_validated_before_compute(tmp_path):
  bad = testing.tiny_config(**{**CASE, "outer.overlap_executor": "threads"})
  with pytest.raises(ValueError,
                     match=r"outer.overlap_executor must be one of auto, thread, inline"):
    Trainer(bad, tmp_path / "bad", devices=jax.devices()[:1])
  no_overlap = testing.tiny_config(**{**CASE, "outer.overlap_steps": 0,
                                      "outer.overlap_executor": "thread"})
  with pytest.raises(ValueError, match=r"overlap_executor=thread: only Streaming DiLoCo or "
                     r"SparseLoCo with outer\.overlap_steps \(τ\) >= 1"):
    Trainer(no_overlap, tmp_path / "none", devices=jax.devices()[:1])
  auto = Trainer(testing.tiny_config(**{**CASE, "outer.overlap_steps": 0}), tmp_path / "auto",
                 devices=jax.devices()[:1])
  assert auto.overlap_executor == "inline"
  assert not (tmp_path / "bad").exists() and not (tmp_path / "none").exists()


class _MovesOn(overlap.Inline):
  """Inline, but after step `at` it replaces the state with one standing at step `to` and moves
  the data there: what `Remote` does when a lagging elastic learner rejoins the others."""

  def __init__(self, data, at: int, to: int):
    self.data, self.at, self.to, self.step = data, at, to, 0

  def before_step(self, step, phase, state):
    self.step = step
    return phase, state

  def after_step(self, state):
    if self.step != self.at:
      return state
    self.data.set_state({"next_index": self.to})
    return state._replace(step=jax.device_put(np.int32(self.to), state.step.sharding))

  def position(self, step):
    return self.to if step == self.at else step


def test_the_loop_goes_on_from_the_step_its_carrier_moves_to(tmp_path):
  """A carrier that moves the state from step 2 to step 4 makes the loop run steps 5 and 6 next,
  with their data and learning rate: bit-identical to a loop stopped after step 2 and started again
  from step 4 (the elastic learner's rejoin, one loop instead of a restart)."""
  from lowcomm_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  c = testing.tiny_config(num_steps=6, **{"optimizer.warmup_steps": 3})
  trainer = Trainer(c, tmp_path / "run")

  def data():
    return iter(pipeline.train_dataset(pipeline.splits_of(c).train, c.data.seq_len,
                                       c.data.batch_size, c.seed))

  class Seen(hooks.Hook):
    steps: list = []

    def dispatched(self, step, state, metrics):
      self.steps.append(step)

  moved_data = data()
  moved = trainer.train(trainer.init_state(), 0, 6, [moved_data],
                        _MovesOn(moved_data, at=2, to=4), [Seen()])
  assert Seen.steps == [1, 2, 5, 6]
  again_data = data()
  state = trainer.train(trainer.init_state(), 0, 2, [again_data], overlap.Inline(), [])
  again_data.set_state({"next_index": 4})
  state = state._replace(step=jax.device_put(np.int32(4), state.step.sharding))
  again = trainer.train(state, 4, 6, [again_data], overlap.Inline(), [])
  assert int(moved.step) == int(again.step) == 6
  for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert Seen.steps == [1, 2, 5, 6]  # the second loop had no hook
