"""Elastic learners on a real local Ray cluster (127.0.0.1): equivalence, faults, bad input."""

import json
import os
import pathlib
import signal

import jax
import numpy as np
import pytest

from lowcomm_jax import config as config_lib
from lowcomm_jax.elastic import options
from lowcomm_jax.train import faults as faults_lib

CONFIGS = pathlib.Path(__file__).parent.parent / "experiments" / "configs"


def _config(**changes):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("elastic_config", CONFIGS / "elastic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("tiny")
  base = {"num_steps": 10, "outer.sync_every": 5, "data.seq_len": 32, "data.batch_size": 4,
          "eval.batch_size": 4, "eval.num_batches": 1, "eval.every": 1000, "log_every": 5,
          "checkpoint.every": 5, "checkpoint.keep": 4, "elastic.num_learners": 2,
          "elastic.min_quorum": 0, "num_replicas": 2, "progress_bar": False}
  return config_lib.override(c, {**base, **changes})


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
  from lowcomm_jax.elastic import driver as run_lib  # pylint: disable=g-import-not-at-top
  # the module's runs share one compilation cache (a learner's program is the same in each)
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
  ray, started = run_lib.start_ray("", 4, str(tmp_path_factory.mktemp("ray")))
  yield ray
  if started:
    ray.shutdown()
  if cache is None:
    del os.environ["JAX_COMPILATION_CACHE_DIR"]
  else:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache


_spmd_runs: dict = {}  # the SPMD runs' results by fingerprint: each trained once per module


def _spmd_globals(config, workdir):
  """φ after each round of the SPMD run of `config`: after every step that consumes a round's mean
  (`consumes`), in the order the rounds close; with the steps and the summary. Trained once per
  module for each config (run-time keys aside)."""
  key = json.dumps(config_lib.fingerprint(options.spmd_config(config)), sort_keys=True, default=str)
  if key not in _spmd_runs:
    _spmd_runs[key] = _train_spmd(config, workdir)
  return _spmd_runs[key]


def _train_spmd(config, workdir):
  from lowcomm_jax.train import hooks, trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  trainer = trainer_lib.Trainer(options.spmd_config(config), workdir)
  tx = trainer.algorithm.tx

  class Rounds(hooks.Hook):
    found: list = []
    steps: list = []

    def after_step(self, step, phase, state, metrics):
      if tx.consumes(phase):
        self.found.append(jax.device_get(trainer.source.eval_params(state)))
        self.steps.append(step)
      return state

  summary = trainer.run(hooks=[Rounds()])
  return Rounds.found, Rounds.steps, summary


def _syncer_globals(workdir, with_start: bool = False):
  """φ after each round of an elastic run (the syncer saves φ_0, then after every round); with
  `with_start`, φ_0 first."""
  from lowcomm_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir) / "syncer", 10)
  found = []
  for step in sorted(ckpt.manager.all_steps())[0 if with_start else 1:]:
    restored = ckpt.manager.restore(step)
    found.append(jax.tree.map(np.asarray, dict(restored["state"])["phi"]))
  ckpt.close()
  return found


def _chunks_beyond(beyond, chunk_size: int) -> int:
  """How many of a leaf's top-k chunks (its flattened values in runs of `chunk_size`, as
  `codecs.TopKCompressor` cuts them) hold an element of the boolean array `beyond`."""
  flat = beyond.reshape(-1)
  c = min(chunk_size, flat.size)
  return int(np.pad(flat, (0, -flat.size % c)).reshape(-1, c).any(1).sum())


def _equal_to_the_spmd_run(config, tmp_path, rounds_in_run: int = 2, goodput: float = 1.0,
                           chunk_size: int | None = None):
  """(elastic summary, SPMD summary, φ per round) of `config` (no faults, full quorum), φ after
  each of its `rounds_in_run` rounds checked against the SPMD run's: within float32 rounding of the
  inner steps before it (θ + (θ' − θ) vs θ', the mean's sum order), a few units in the last place
  of the parameters' scale per step, the budget 8 ulp per step.

  With `chunk_size` (a top-k exchange of chunks of that size), a round may also differ in a few
  whole chunks: the two runs' Δ differ in their last bits, and where two of a chunk's values are
  that close to a tie in |x| (or a value to a 2-bit bin's edge), the top-k choice or the bin can
  fall either way, which moves that chunk's decoded values by up to a level. Such a round must
  still agree within the rounding bound outside at most 1% of the chunks (a wrong merge, scale or
  wire format would break nearly every chunk), and inside them by no more than twice the SPMD
  round's largest step of φ. The rounds after it start from a different φ, so they are held only
  to the final eval loss (within 1e-3 relative)."""
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  summary = elastic.run(config, tmp_path / "elastic")
  spmd, steps, spmd_summary = _spmd_globals(config, tmp_path / "spmd")
  start, *rounds = _syncer_globals(tmp_path / "elastic", with_start=True)
  assert len(rounds) == len(spmd) == rounds_in_run
  for r, (ours, theirs, before) in enumerate(zip(rounds, spmd, [start] + spmd)):
    worst, flipped, chunks = 0.0, 0, 0
    for (path, a), b, p in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs),
                               jax.tree.leaves(before)):
      a, b, p = (np.asarray(x, np.float32) for x in (a, b, p))
      bound = 8 * np.finfo(np.float32).eps * float(np.abs(b).max()) * steps[r]
      beyond = np.abs(a - b) > bound
      if chunk_size is None:
        assert not beyond.any(), (r, jax.tree_util.keystr(path))
      else:
        flipped += _chunks_beyond(beyond, chunk_size)
        chunks += _chunks_beyond(np.ones_like(beyond), chunk_size)
        assert float(np.abs(a - b).max()) <= 2 * float(np.abs(b - p).max()) + bound, (
            r, jax.tree_util.keystr(path))
      worst = max(worst, float(np.abs(a - b).max()) / bound)
    print(f"{config.algorithm} round {r}: max |φ − φ_spmd| is {worst:.3g} of its leaf's bound"
          + (f", {flipped} of {chunks} chunks beyond it" if chunk_size else ""))
    assert flipped <= chunks // 100, (r, flipped, chunks)
    if flipped:  # the later rounds start from another φ
      np.testing.assert_allclose(summary["final_eval_loss"], spmd_summary["final_eval_loss"],
                                 rtol=1e-3)
      break
  assert summary["goodput"] == pytest.approx(goodput, rel=1e-12)
  assert summary["participation"] == 1.0
  return summary, spmd_summary, rounds


def test_no_faults_and_full_quorum_equal_the_spmd_run(ray_cluster, tmp_path):
  summary, spmd_summary, _ = _equal_to_the_spmd_run(_config(), tmp_path)
  assert summary["deaths"] == [] and summary["rounds"] == [2]
  np.testing.assert_allclose(summary["final_eval_loss"], spmd_summary["final_eval_loss"], rtol=1e-4)
  # bytes on the wire: each learner sends Δ (float32, the whole model) and receives the mean Δ
  # every round
  param_bytes = 4 * spmd_summary["num_params"]
  assert summary["bytes_sent_per_learner"] == [2 * param_bytes] * 2
  assert summary["bytes_received_per_learner"] == [2 * param_bytes] * 2
  lines = [json.loads(l) for l in (tmp_path / "elastic" / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines if "participation" in l] == [5, 10]


def test_sparseloco_with_no_faults_and_full_quorum_equals_its_spmd_run(ray_cluster, tmp_path):
  """SparseLoCo's sparse payloads through the syncer (`comm.remote`'s sparse_gather wire format),
  merged as the all-gather's scatter-add mean: φ after each round equal to the SPMD run's, within
  the same rounding bound as DiLoCo's but for the few chunks where a near-tie may fall the other
  way (see `_equal_to_the_spmd_run`). The wire format itself is checked bit for bit against the
  collective in `test_sparseloco_compression.py`."""
  from lowcomm_jax import comm  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.codecs.topk import TopKCompressor  # pylint: disable=g-import-not-at-top
  summary, spmd_summary, rounds = _equal_to_the_spmd_run(_config(**{
      "algorithm": "sparseloco", "sparseloco.chunk_size": 64,
      "sparseloco.top_k": 8}), tmp_path, chunk_size=64)
  # not vacuous: the second round's sparse mean moved φ
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(rounds[0]), jax.tree.leaves(rounds[1])))
  # bytes on the wire: each learner sends its sparse payload per round and receives the dense mean
  payload = comm.sparse_mean_wire_bytes(rounds[0], TopKCompressor(64, 8, 2))
  assert summary["bytes_sent_per_learner"] == [2 * payload] * 2
  assert summary["bytes_received_per_learner"] == [2 * 4 * spmd_summary["num_params"]] * 2


def test_streaming_diloco_with_no_faults_and_full_quorum_equals_its_spmd_run(ray_cluster,
                                                                             tmp_path):
  """Streaming DiLoCo through the syncer: P = 3 staggered fragments (tiny's two blocks, and the
  rest) of H = 6, each Δ_p sent before its step's program and merged τ = 1 step later with
  α = 0.5, every fragment its own round. φ after each of the 5 rounds of the 12 steps (steps 3, 5,
  7, 9 and 11) equal to the SPMD run's at those steps, within DiLoCo's bound."""
  summary, _, rounds = _equal_to_the_spmd_run(_config(**{
      "algorithm": "streaming_diloco", "num_steps": 12, "outer.sync_every": 6,
      "outer.num_fragments": 2, "outer.overlap_steps": 1, "outer.merge_alpha": 0.5,
      "checkpoint.keep": 6}), tmp_path, rounds_in_run=5,
      # a fragment's steps after its last send are never merged: fragment 0's last Δ (sent with
      # step 9) covers steps 1-8, fragment 1's 1-10, fragment 2's 1-6: 24 of the 36 steps
      goodput=24 / 36)
  # every round changed only its own fragment's part of φ, and changed it
  moved = [[not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y))]
           for x, y in zip(rounds, rounds[1:])]
  assert all(any(m) and not all(m) for m in moved), moved
  assert summary["rounds"] == [2, 2, 1]


def test_eager_two_outer_steps_late_through_the_syncer_equals_its_spmd_run(ray_cluster, tmp_path):
  """Eager DiLoCo with τ = 2H (H = 5, 20 steps) on the remote carrier: each learner keeps its own
  φ_m and runs its outer step at every sync step with its proxy, the mean of each lane landing
  through the syncer two sync steps after it was sent (lane 0 sent with steps 6 and 16, lane 1
  with 11; lane 0's first mean enters the proxy at step 15, whose Δ is sent with 16). Every mean
  the syncer merged equals the SPMD run's in-flight mean of that send, so each learner's Δ_m, and
  with it its φ_m, equals replica m's; the syncer's φ is DiLoCo's outer step on those means in
  turn (`options.syncer_algorithm`), within the elastic equivalence bound."""
  import optax  # pylint: disable=g-import-not-at-top

  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import algorithms, hooks, trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  config = _config(**{"num_steps": 20, "outer.overlap_steps": 10, "outer.eager": True,
                      "checkpoint.keep": 6})
  summary = elastic.run(config, tmp_path / "elastic")
  assert summary["rounds"] == [2, 1]  # "fragment 0" (lane 0), "fragment 0, lane 1"
  # inline: the in-flight buffer holds each mean from its send step on
  trainer = trainer_lib.Trainer(config_lib.override(options.spmd_config(config), {
      "outer.overlap_executor": "inline"}), tmp_path / "spmd")
  tx = trainer.algorithm.tx

  class Sent(hooks.Hook):
    means: list = []  # (step, the mean of the send made in that step)

    def after_step(self, step, phase, state, metrics):
      for name in tx.plans(phase):
        self.means.append((step, jax.device_get(state.opt_state.comm.in_flight[name])))
      return state

  trainer.run(hooks=[Sent()])
  assert [step for step, _ in Sent.means] == [6, 11, 16]
  outer = algorithms.make_outer_optimizer(config.outer_optimizer)
  phi = jax.tree.map(lambda x: np.asarray(x, np.float32), trainer.init_params())
  outer_state, expected = outer.init(phi), []
  for _, mean in Sent.means:
    updates, outer_state = outer.update(mean, outer_state, phi)
    phi = optax.apply_updates(phi, updates)
    expected.append(phi)
  rounds = _syncer_globals(tmp_path / "elastic")
  assert len(rounds) == 3
  for r, (ours, theirs) in enumerate(zip(rounds, expected)):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
      b = np.asarray(b, np.float32)
      bound = 8 * np.finfo(np.float32).eps * float(np.abs(b).max()) * Sent.means[r][0]
      assert float(np.abs(np.asarray(a, np.float32) - b).max()) <= bound, r
  # not vacuous: the last mean holds the landed mean's proxy (far from the first's)
  first, last = (jax.tree.leaves(m) for _, m in (Sent.means[0], Sent.means[2]))
  assert any(not np.allclose(a, b) for a, b in zip(first, last))


def test_bad_input_is_refused_before_anything_starts(tmp_path):
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  cases = {
      "elastic.min_quorum": (3, "elastic.min_quorum must be an integer in [0, 3)"),
      "elastic.grace_s": (-1.0, "elastic.grace_s must be"),
      "elastic.faults": ("explode:learner=0:step=3",
                         "elastic.faults: unknown fault kind 'explode'"),
      "algorithm": ("noloco", "algorithm=noloco cannot run elastic: a syncer carries plans of "
                              "kind mean, compressed_mean, sparse_gather"),
      "elastic.staleness": ("stalest", "elastic.staleness must be one of inverse, cutoff, none, "
                                       "heloco"),
      "elastic.speeds": ("1,0", "elastic.speeds must be 2 numbers > 0"),
      "elastic.buffer_barrier": (True, "elastic.buffer_barrier must be False unless "
                                       "elastic.asynchronous=True"),
  }
  asynchronous = {"elastic.asynchronous": True}
  combined = [  # (changes, message)
      ({**asynchronous, "algorithm": "streaming_diloco"},
       "algorithm must be diloco for elastic.asynchronous=True"),
      ({"outer_optimizer.name": "adam", "outer_optimizer.momentum_every": 2},
       "outer_optimizer.momentum_every must be 1 unless outer_optimizer.name=nesterov"),
      ({**asynchronous, "elastic.max_staleness": -1},
       "elastic.max_staleness must be an integer >= 0"),
      ({**asynchronous, "outer.eager": True, "outer.overlap_steps": 5},
       "outer.eager must be False with elastic.asynchronous=True"),
      ({"elastic.staleness": "heloco"},
       "elastic.staleness must be inverse, cutoff or none unless elastic.asynchronous=True"),
      ({**asynchronous, "elastic.staleness": "heloco", "outer_optimizer.momentum": 0.0},
       "outer_optimizer.name/momentum must be nesterov/> 0 with elastic.staleness=heloco"),
      ({**asynchronous, "elastic.staleness": "heloco", "elastic.heloco_keep": 1.5},
       "elastic.heloco_keep must be a number in [-1, 1], got 1.5"),
  ]
  for i, (changes, message) in enumerate([({k: v}, m) for k, (v, m) in cases.items()] + combined):
    workdir = tmp_path / f"case{i}"
    with pytest.raises(ValueError) as error:
      elastic.run(_config(**changes), workdir)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert not workdir.exists()
  with pytest.raises(ValueError, match="learner must be in \\[0, 2\\)"):
    faults_lib.parse("kill:learner=2:step=4", 2)


def test_the_binary_refuses_in_one_line_before_ray_starts(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top,multiple-imports
  import sys
  proc = subprocess.run(
      [sys.executable, str(CONFIGS.parent / "elastic.py"),
       f"--config={CONFIGS / 'elastic.py'}:tiny",
       f"--workdir={tmp_path / 'run'}", "--config.elastic.faults=kill:learner=7:step=3"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.startswith("ValueError: elastic.faults: 'kill:learner=7:step=3': learner must "
                                "be in [0, 4)"), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def _reference(config, workdir) -> dict:
  """The summary of the fault-free SPMD run of `config`, saved once, at its end (only its eval loss
  is compared)."""
  from lowcomm_jax.train import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  spmd = config_lib.override(options.spmd_config(config), {"checkpoint.every": config.num_steps})
  return trainer_lib.Trainer(spmd, workdir).run()


def _events(workdir, learner):
  from lowcomm_jax.elastic import driver  # pylint: disable=g-import-not-at-top
  return driver.events(workdir, learner)


def _waits(workdir, learner):
  """Seconds learner `learner` waited for each round it sent to."""
  ev = _events(workdir, learner)
  return [b["time"] - a["time"] for a, b in zip(ev, ev[1:])
          if a["event"] == "sync_begin" and b["event"] == "sync_end"]


def test_a_killed_learner_rejoins_while_the_others_go_on_and_the_syncer_restarts(ray_cluster,
                                                                                  tmp_path):
  """3 learners, quorum 1, grace 1.5 s: learner 1 killed after step 10, learner 2 stopped (SIGSTOP)
  after step 12, the syncer killed in round 3; against the fault-free SPMD run. Learner 0 goes on
  alone until step 60, where it stops too; this test wakes learners 0 and 2 once the restarted
  learner 1 has had a Δ merged, so that the run outlasts learner 1's restart on any machine, under
  any load (the stops' own end, 600 s, is a fallback)."""
  import time  # pylint: disable=g-import-not-at-top

  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  grace, steps, h = 1.5, 100, 10
  config = _config(**{"num_steps": steps, "outer.sync_every": h, "elastic.num_learners": 3,
                      "num_replicas": 3, "elastic.min_quorum": 1, "elastic.grace_s": grace,
                      "checkpoint.keep": 2, "elastic.faults": "kill:learner=1:step=10,"
                      "stop:learner=2:step=12:seconds=600,stop:learner=0:step=60:seconds=600,"
                      "kill_syncer:round=3"})
  work = tmp_path / "elastic"
  run = elastic.start(config, work)
  fired = lambda i, kind: any(ev["event"] == kind for ev in _events(work, i))

  def merged_after_death():
    died = [ev["time"] for ev in _events(work, 1) if ev["event"] == "kill"]
    return died and any(ev["event"] == "sync_end" and ev["accepted"] and ev["time"] > died[0]
                        for ev in _events(work, 1))

  try:
    _wait_for(run, lambda: fired(0, "stop") and fired(2, "stop") and merged_after_death(),
              "learners 0 and 2 stopped and learner 1 merged again after its restart")
  finally:
    woken = time.time()
    for i in (0, 2):
      _wake(_pid(work, i))
  summary = run.wait()
  assert summary["rounds"] == [steps // h]
  assert summary["faults"] == ["kill-learner1-step10", "kill_syncer-round3", "stop-learner0-step60",
                               "stop-learner2-step12"]
  # the killed learner: one death, restarted by Ray, rejoined before the end and merged again
  [death] = summary["deaths"]
  assert death["learner"] == 1 and len(summary["rejoin_s"]) == 1
  after = [ev for ev in _events(work, 1) if ev["time"] > death["time"]]
  [rejoined] = [ev for ev in after if ev["event"] == "joined"]
  assert rejoined["step"] < steps
  lines = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
  rounds = [int(l["round"]) for l in lines if "participation" in l]
  assert rounds == list(range(steps // h))  # each round once, the syncer's restart included
  # the others never stop: until learner 1 is back (or learner 0 stops at step 60), rounds close
  # while learner 2 is stopped, without it and with learner 0; learner 0 never waits out learner
  # 2's stop (its waits are the grace window and the syncer's save, whatever the machine's load),
  # except in the round the syncer died in (Ray restarts it and resends what was in flight)
  [stop] = [ev for ev in _events(work, 2) if ev["event"] == "stop"]
  [hold] = [ev["time"] for ev in _events(work, 0) if ev["event"] == "stop"]
  during = [r for r in _round_records(work)
            if stop["time"] < r["time"] < min(rejoined["time"], hold)]
  assert during and all(0 in r["accepted"] and 2 not in r["contributors"] for r in during), during
  waits = _waits(work, 0)
  assert len(waits) >= steps // h - 2 and sorted(waits)[-2] < woken - stop["time"], waits
  assert summary["participation_per_learner"][2] < summary["participation_per_learner"][0]
  assert 0 < summary["goodput"] < 1
  # what the faults cost: learner 2 is silent for most rounds and learner 1 misses some, so about
  # half the fault-free run's Δs are merged; early in training that moves the eval loss by a few
  # per cent either way (benchmarks/elastic.py measures the cost on long runs). A merge that broke
  # the model after a restart (a wrong φ, a stale fragment) would be far above 5 %.
  reference = _reference(config, tmp_path / "spmd")
  assert summary["final_eval_loss"] <= 1.05 * reference["final_eval_loss"], (
      summary["final_eval_loss"], reference["final_eval_loss"])


def test_a_killed_learner_heals_into_the_run_it_left(ray_cluster, tmp_path):
  """3 learners, full quorum, H = 10: learner 1 is killed right after round 0 (step 10) and
  learners 0 and 2 are stopped (SIGSTOP) after step 11 until learner 1's restart has joined the
  syncer again (this test wakes them), so that the heal falls inside round 1 on any machine and no
  learner's data is lost to the fault. The restarted learner must heal to where it was: φ of
  round 0, step 10, a peer's inner optimizer state and the data from step 11. What differs from the
  fault-free run is its Adam moments (the peer's, one step ahead): the eval loss within 2% of the
  fault-free SPMD run (+0.2% where measured). A heal that kept a fresh inner optimizer state (+8%),
  or φ_0 and step 0 (+3%), fails it."""
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  steps, h = 30, 10
  # the stops' own end (600 s) is a fallback: the test wakes them as soon as learner 1 is back
  config = _config(**{"num_steps": steps, "outer.sync_every": h, "elastic.num_learners": 3,
                      "num_replicas": 3, "elastic.min_quorum": 3, "elastic.grace_s": 1.0,
                      "elastic.faults": "kill:learner=1:step=10,stop:learner=0:step=11:seconds=600,"
                                        "stop:learner=2:step=11:seconds=600"})
  work = tmp_path / "elastic"
  run = elastic.start(config, work)
  fired = lambda i, kind: any(ev["event"] == kind for ev in _events(work, i))
  try:
    # learner 1 records its kill after round 0's mean has come, as the others do their step 11:
    # either may be first
    _wait_for(run, lambda: fired(0, "stop") and fired(2, "stop") and fired(1, "kill"),
              "learners 0 and 2 stopped, learner 1 killed")
    killed_at = [ev["time"] for ev in _events(work, 1) if ev["event"] == "kill"][0]
    rerun = lambda: any(ev["event"] == "run" and ev["time"] > killed_at for ev in _events(work, 1))
    _wait_for(run, lambda: rerun() and 1 in run.status()["live"], "learner 1 back in the run")
  finally:
    for i in (0, 2):
      _wake(_pid(work, i))
  summary = run.wait()
  [death] = summary["deaths"]
  assert death["learner"] == 1 and len(summary["rejoin_s"]) == 1
  joined = [ev["step"] for ev in _events(work, 1) if ev["event"] == "joined"]
  assert joined == [0, h]  # the first start, then the heal at round 0's step
  # every round merged all three learners' Δ: nothing was lost to the kill
  assert [r["accepted"] for r in _round_records(work)] == [[0, 1, 2]] * (steps // h)
  assert summary["goodput"] == 1.0
  reference = _reference(config, tmp_path / "spmd")
  gap = summary["final_eval_loss"] / reference["final_eval_loss"] - 1
  assert abs(gap) <= 0.02, (summary["final_eval_loss"], reference["final_eval_loss"])


def test_a_straggler_does_not_hold_the_others_back_beyond_the_grace_window(ray_cluster, tmp_path):
  """2 learners, quorum 1, grace 0.02 s, learner 1 fifty times slower from its first step. Its
  first round takes 20 × 50 of its step times: more than learner 0's two rounds (2 × 20 step
  times) with what each round boundary costs besides the steps (the syncer's outer step and save,
  the merge: hundreds of step times of this tiny model). Every round closes with learner 0's Δ
  alone, before the straggler's has come."""
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  grace = 0.02
  config = _config(**{"num_steps": 40, "outer.sync_every": 20, "elastic.min_quorum": 1,
                      "elastic.grace_s": grace,
                      "elastic.faults": "slow:learner=1:step=1:factor=50"})
  summary = elastic.run(config, tmp_path / "elastic")
  assert summary["rounds"] == [2] and summary["deaths"] == []
  assert len(_waits(tmp_path / "elastic", 0)) == 2
  records = _round_records(tmp_path / "elastic")
  assert [(r["contributors"], r["accepted"]) for r in records] == [([0], [0])] * 2, records
  fast, slow = summary["participation_per_learner"]
  assert fast == 1.0 and slow < 1.0 and summary["goodput"] < 1


def _wait_for(run, condition, what: str):
  """Polls `condition` while `run` goes on (a run that ends first fails the test; a hang is the
  tier's timeout, tests/conftest.py)."""
  import time  # pylint: disable=g-import-not-at-top
  while not condition():
    try:
      run.status()
    except RuntimeError as error:
      raise AssertionError(f"the run ended before {what}") from error
    time.sleep(0.1)


def _wake(pid: int, within_s: float = 120.0) -> None:
  """SIGCONT to a learner that logged its `stop`, once it is stopped: the stop's own process sends
  SIGSTOP just after the event is written, and a SIGCONT before it would be lost."""
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.time() + within_s
  while time.time() < deadline:
    try:
      status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
      return  # it ended
    if any(line.startswith("State:") and "stopped" in line for line in status.splitlines()):
      break
    time.sleep(0.05)
  os.kill(pid, signal.SIGCONT)


def _pid(work, learner: int) -> int:
  """The process of learner `learner`'s latest start."""
  return [ev["pid"] for ev in _events(work, learner) if ev["event"] == "start"][-1]


def test_learners_added_and_removed_while_it_runs_and_a_resume_with_another_count(ray_cluster,
                                                                                   tmp_path):
  """2 learners, quorum 2, H = 5. After round 2 learner 1 is stopped (SIGSTOP) by this test, which
  holds the open round (it waits for its quorum): learner 2 is added then, learner 0 removed once
  learner 2's Δ was merged, and learner 1 woken (SIGCONT); the run stops at step 40
  (`stop_at_step`) and resumes with `elastic.num_learners=3`: learners 0, 1, 2 to step 60."""
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  work = tmp_path / "elastic"
  config = _config(**{"num_steps": 60, "stop_at_step": 40, "elastic.grace_s": 1.0})
  run = elastic.start(config, work)
  _wait_for(run, lambda: run.status()["rounds"][0] >= 2, "round 2")
  os.kill(_pid(work, 1), signal.SIGSTOP)
  try:
    assert run.add_learner() == 2
    merged = lambda i: any(ev["event"] == "sync_end" and ev["accepted"] for ev in _events(work, i))
    _wait_for(run, lambda: merged(2), "learner 2's first merged Δ")
    with pytest.raises(ValueError) as error:
      run.remove_learner(7)
    assert str(error.value) == ("remove_learner's learner must be one of the run's learners "
                                "[0, 1, 2], got 7")
    run.remove_learner(0)
  finally:
    os.kill(_pid(work, 1), signal.SIGCONT)
  stopped = run.wait()
  assert stopped["complete"] is False and stopped["step"] == 40 and stopped["members"] == [1, 2]
  assert workdir_lib.read_summary(work) is None  # not finished: a start resumes it
  assert _events(work, 0)[-1]["event"] == "removed"
  with pytest.raises(RuntimeError, match="is not going on"):
    run.add_learner()

  resumed = elastic.run(config_lib.override(config, {"stop_at_step": -1,
                                                     "elastic.num_learners": 3}), work)
  assert resumed["learners"] == 3 and resumed["members"] == [0, 1, 2]
  assert resumed["added"] == [2] and resumed["removed"] == [0]
  assert resumed["rounds"] == [12]
  lines = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
  assert [int(l["round"]) for l in lines if "participation" in l] == list(range(12))
  rounds = _round_records(work)
  added_at = [ev["time"] for ev in _events(work, 2) if ev["event"] == "joined"][0]
  removed_at = [ev["time"] for ev in _events(work, 0) if ev["event"] == "removed"][0]
  before_resume = [r for r in rounds if r["round"] < 8]
  # learner 2 merged from its join on; learner 0 not between its removal and the resume
  assert any(2 in r["accepted"] for r in before_resume if r["time"] > added_at)
  assert not any(0 in r["accepted"] for r in before_resume if r["time"] > removed_at)
  assert all(2 not in r["contributors"] for r in rounds if r["time"] < added_at)
  # after the resume: learner 0 a member again, from the syncer's step 40, merged again
  joined = [ev for ev in _events(work, 0) if ev["event"] == "joined" and ev["time"] > removed_at]
  assert [ev["step"] for ev in joined] == [40]
  assert any(0 in r["accepted"] for r in rounds if r["round"] >= 8)
  first_loss = [l["loss"] for l in lines if "participation" in l][0]
  assert resumed["final_eval_loss"] < first_loss  # it trained on, through all of that


def _round_records(work):
  return json.loads((pathlib.Path(work) / "summary.json").read_text())["round_log"]


def test_the_adaptive_grace_window_waits_only_for_learners_expected_in_time():
  from lowcomm_jax.elastic import grace  # pylint: disable=g-import-not-at-top
  arrivals = grace.Arrivals()
  for learner, times in {0: (0, 10, 20), 1: (1, 11, 21), 2: (0, 30, 60), 3: (25,), 4: (4, 18),
                         5: (0, 10, 20, 60, 70)}.items():
    for t in times:
      arrivals.arrived(0, learner, float(t))
  arrivals.arrived(1, 1, 5.0)  # another fragment's arrivals are its own
  predicted = lambda i: arrivals.predicted(0, i)
  assert predicted(0) == (30.0, 10.0) and predicted(2) == (90.0, 30.0) and predicted(3) is None
  assert predicted(5) == (80.0, 10.0)  # the median interval: one slow round does not set the pace
  end = lambda now, missing, fn=predicted: grace.window_end(30.0, 5.0, now, missing, fn)
  # quorum in at t = 30, cap 35: learner 1 is due at 31, waited for up to 31 + 0.25 · 10
  assert end(30.0, {1}) == 33.5 and end(30.0, {1, 2}) == 33.5
  assert end(30.0, {2}) == 30.0  # a straggler due at 90: the round closes with its quorum
  assert end(34.0, {1}) == 34.0  # overdue (stopped, or dead and not yet seen): no more waiting
  assert end(30.0, {1, 3}) == 35.0  # a pace not known yet: the whole window
  assert end(30.0, {4}) == 35.0  # due at 32 with slack to 35.5: the cap
  assert end(30.0, {2}, None) == 35.0  # the fixed window
  arrivals.forget(1)
  assert predicted(1) is None and arrivals.predicted(1, 1) is None


def test_the_syncer_stops_waiting_for_an_overdue_learner_with_the_adaptive_window(tmp_path):
  """The syncer in this process (no Ray), 3 learners, quorum 2, grace 3 s: in rounds 0 and 1 all
  three send, 0.2 s after the last round closed; in round 2 learner 2 is silent (stopped). The
  adaptive window closes round 2 once learner 2 is overdue (its interval, plus a quarter, after its
  last Δ); the fixed one waits the whole 3 s."""
  import asyncio  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.comm import remote  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.elastic import syncer as syncer_lib  # pylint: disable=g-import-not-at-top
  cache = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
                                               "jax_persistent_cache_min_entry_size_bytes")}
  waited = {}
  try:
    for adaptive in (True, False):
      config = _config(**{"num_steps": 30, "elastic.num_learners": 3, "num_replicas": 3,
                          "elastic.min_quorum": 2, "elastic.grace_s": 3.0,
                          "elastic.adaptive_grace": adaptive})
      syncer = syncer_lib.Syncer(config.to_json_best_effort(), str(tmp_path / str(adaptive)))
      payload, _ = remote.encode(syncer.plans[0], syncer.names[0], syncer.zeros(0))

      async def rounds(syncer=syncer, payload=payload):
        for i in range(3):
          syncer.join(i)
        for r in range(3):
          await asyncio.gather(*[syncer.exchange(i, 0, r, payload, 128, 5 * (r + 1), 1.0)
                                 for i in ((0, 1, 2) if r < 2 else (0, 1))])
          await asyncio.sleep(0.2)

      asyncio.run(rounds())
      records = syncer.stats["rounds"]
      assert [r["accepted"] for r in records] == [[0, 1, 2], [0, 1, 2], [0, 1]]
      waited[adaptive] = [r["grace_waited_s"] for r in records]
      syncer.writer.close()
      syncer.ckpt.close()
  finally:
    for key, value in cache.items():
      jax.config.update(key, value)
  assert waited[False][2] >= 3.0  # the fixed window: the whole grace_s
  # adaptive: a quarter of learner 2's interval (0.2 s plus a round's close) past its prediction,
  # so it closes before the whole window however slow the machine makes that interval (up to ~2 s)
  assert waited[True][2] < 3.0, waited


def _async_config(**changes):
  return _config(**{"elastic.asynchronous": True, "outer_optimizer.momentum_every": 2,
                    "checkpoint.keep": 20, "elastic.log_deltas": True, **changes})


def test_asynchronous_with_a_buffer_barrier_and_equal_speeds_equals_the_spmd_run(ray_cluster,
                                                                                   tmp_path):
  """Asynchronous learners with Delayed Nesterov (N = 2 = learners), a barrier on each buffer and
  no staleness: each learner's Δ merged alone (a plain step of Δ/N, then the momentum step of the
  buffer), both from the same φ; φ after each buffer equals synchronous DiLoCo's after its round,
  within the elastic equivalence bound (the two merges sum Δ_0/2 + Δ_1/2 in arrival order where
  the round takes their mean). The merge log replays φ bit for bit on this process."""
  from lowcomm_jax.elastic import merge_log, syncer  # pylint: disable=g-import-not-at-top
  config = _async_config(**{"elastic.buffer_barrier": True, "elastic.staleness": "none"})
  summary = elastic_run(config, tmp_path / "elastic")
  # synchronous DiLoCo: every round's mean through Nesterov (momentum every outer step), the run
  # test_no_faults_and_full_quorum_equal_the_spmd_run compares with
  spmd, steps, _ = _spmd_globals(_config(), tmp_path / "spmd")
  merges = [json.loads(l) for l in
            (tmp_path / "elastic" / "syncer" / syncer.MERGE_LOG).read_text().splitlines()]
  assert [(m["base_version"], m["staleness"], m["weight"], m["version"]) for m in merges] == [
      (0, 0, 1.0, 1), (0, 1, 1.0, 2), (2, 0, 1.0, 3), (2, 1, 1.0, 4)]
  assert sorted(m["learner"] for m in merges[:2]) == [0, 1] == sorted(
      m["learner"] for m in merges[2:])
  buffers = _syncer_globals(tmp_path / "elastic")[1::2]  # after merges 2 and 4
  assert len(buffers) == len(spmd) == 2
  for r, (ours, theirs) in enumerate(zip(buffers, spmd)):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
      b = np.asarray(b, np.float32)
      bound = 8 * np.finfo(np.float32).eps * float(np.abs(b).max()) * steps[r]
      assert float(np.abs(np.asarray(a, np.float32) - b).max()) <= bound, r
  assert summary["goodput"] == 1.0
  replayed = merge_log.replay(tmp_path / "elastic")
  assert replayed["merges"] == 4
  for a, b in zip(jax.tree.leaves(replayed["phi"]), jax.tree.leaves(replayed["saved"])):
    np.testing.assert_array_equal(a, b)


def elastic_run(config, workdir):
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  return elastic.run(config, workdir)


def test_asynchronous_learners_of_different_speeds_merge_stale_deltas_by_the_rule(ray_cluster,
                                                                                  tmp_path):
  """Learner 1 four times slower (elastic.speeds) syncs every H_1 = 1 of its own steps for 2 steps
  (local_steps=by_speed: H = 5 for learner 0, 10 steps), no barrier: every line of the merge log
  is its Δ's staleness s (merges into φ since its base version), r = ⌊s / 2⌋ rounds behind, and
  its weight 1/(1 + r) × its tokens over the learners' mean phase ((5 + 1)/2 steps); each
  learner's sends all merged; the log replays φ bit for bit."""
  from lowcomm_jax.elastic import merge_log, syncer  # pylint: disable=g-import-not-at-top
  config = _async_config(**{"elastic.speeds": "1,0.25", "elastic.local_steps": "by_speed",
                            "elastic.staleness": "inverse"})
  summary = elastic_run(config, tmp_path / "elastic")
  merges = [json.loads(l) for l in
            (tmp_path / "elastic" / "syncer" / syncer.MERGE_LOG).read_text().splitlines()]
  assert sorted(m["learner"] for m in merges) == [0, 0, 1, 1]
  assert [m["step"] for m in merges if m["learner"] == 0] == [5, 10]
  assert [m["step"] for m in merges if m["learner"] == 1] == [1, 2]
  tokens = 4 * 32  # data.batch_size × data.seq_len per step
  for n, m in enumerate(merges):
    assert m["merge"] == n and m["version"] == n + 1  # nothing dropped: each moved φ
    assert m["staleness"] == n - m["base_version"] and m["rounds_behind"] == m["staleness"] // 2
    assert m["tokens"] == tokens * (5 if m["learner"] == 0 else 1)
    assert m["weight"] == pytest.approx(m["tokens"] / (3 * tokens) / (1 + m["rounds_behind"]),
                                        rel=1e-12)
  assert summary["tokens_merged"] == 12 * tokens
  # both learners' first Δ start from φ_0: the one merged second is stale whatever the timing
  assert max(m["staleness"] for m in merges) >= 1
  replayed = merge_log.replay(tmp_path / "elastic")
  for a, b in zip(jax.tree.leaves(replayed["phi"]), jax.tree.leaves(replayed["saved"])):
    np.testing.assert_array_equal(a, b)
