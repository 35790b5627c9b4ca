"""The one engine, over every algorithm and gradient source (lowcomm_jax.testing.ENGINE_CASES):
golden first-step and first-sync metrics, resume mid-round bit-identical, one device = the mesh,
ledger bytes = the collectives of the compiled program, a NaN/inf never reaches the global model,
bad input refused before anything is written."""

import json
import re

import jax
import numpy as np
import pytest

from lowcomm_jax import checks, codecs, hlo, testing
from lowcomm_jax.testing import (
  COMPOSED_CASES,
  ENGINE_CASES,
  PROCESS_CASES,
  ROOT,
  collective_bytes,
  engine_config,
  launch_script,
  process_leg_config,
  read_metrics,
  tree_hash,
)
from lowcomm_jax.train import Trainer, algorithms, hooks

CASES = sorted(ENGINE_CASES)
ONE_DEVICE = {"pipeline_noloco": None, "pipeline_diloco": None,  # the pipeline needs its grid
              "pipeline_sparseloco": None}

# (loss, grad_norm) of steps 1, sync and sync + 1, produced ONCE from main at commit 12b1c45 (before
# the one-engine redesign) by tests/engine_golden_from_main.py: the Trainer for dp, diloco,
# streaming_diloco and noloco; parallel/combined.py's own pipeline loop for pipeline_*; and
# skippipe/training.py's make_path_train_step for skippipe. The engine must reproduce them to 1e-6.
CHAIN_OF_SUMS = testing.tiny_chain_of_sums(32, 4 * 32)  # engine_config's windows

GOLDEN = {
    "diloco": {
        1: (5.551083564758301, 1.017744541168213),
        3: (5.518357276916504, 1.5341157913208008),
        4: (5.466020584106445, 1.139689564704895),
    },
    "dp": {1: (5.558376789093018, 1.0338369607925415), 2: (5.544163227081299, 0.6954640746116638)},
    "noloco": {
        1: (5.549468040466309, 1.1843241453170776),
        3: (5.515411853790283, 1.40887451171875),
        4: (5.4761247634887695, 1.6454296112060547),
    },
    "pipeline_diloco": {
        1: (5.551084041595459, 1.017744541168213),
        3: (5.5184502601623535, 1.534348726272583),
        4: (5.489950656890869, 1.1412733793258667),
    },
    "pipeline_noloco": {
        1: (5.551084041595459, 1.017744541168213),
        3: (5.5184502601623535, 1.534348726272583),
        4: (5.501721382141113, 1.1417150497436523),
    },
    "skippipe": {1: (5.558516979217529, 1.0339123010635376),
                 2: (5.544247150421143, 0.6955036520957947)},
    # Until its first merge (after step 3) SparseLoCo's replicas run Streaming DiLoCo's inner steps:
    # steps 1 and 3 are streaming_diloco's goldens. Step 4 (after one sparse merge) was produced by
    # the first run of algorithm=sparseloco (chunks of 64, k = 4, 2 bits, β = 0.95, η = 1).
    "sparseloco": {
        1: (5.551083564758301, 1.017744541168213),
        3: (5.518357276916504, 1.5341157913208008),
        4: (5.509421348571777, 1.1415849924087524),
    },
    "streaming_diloco": {
        1: (5.551083564758301, 1.017744541168213),
        3: (5.518357276916504, 1.5341157913208008),
        4: (5.49894905090332, 1.141191840171814),
    },
}


def _devices(case):
  return ONE_DEVICE.get(case, jax.devices()[:1])


_runs: dict = {}


def _whole(tmp_path_factory, case) -> tuple[Trainer, dict, hooks.FinalState]:
  """The finished 6-step run of engine_config(case) on _devices(case), its summary and its final
  state, trained once
  per test module (the golden test and the one-device side of the mesh test both read it; neither
  writes to its directory)."""
  if case not in _runs:
    trainer = Trainer(engine_config(case), tmp_path_factory.mktemp(case) / "whole",
                      devices=_devices(case))
    _runs[case] = trainer, *testing.run_to_end(trainer)
  return _runs[case]


@pytest.mark.parametrize("case", [c for c in CASES if c not in COMPOSED_CASES])
def test_golden_metrics_and_resume_mid_round_is_bit_identical(case, tmp_path, tmp_path_factory):
  whole, summary, whole_final = _whole(tmp_path_factory, case)
  rows = {r["step"]: r for r in read_metrics(whole.workdir)}
  # Another CPU sums in other orders: each step's values within the float32 bound of the tiny
  # model's chain of sums, accumulated over the steps run to get there.
  for step, (loss, grad_norm) in GOLDEN[case].items():
    for name, golden in (("loss", loss), ("grad_norm", grad_norm)):
      testing.assert_within(rows[step][name], golden,
                            testing.trajectory_error_bound(golden, step, CHAIN_OF_SUMS),
                            f"{name} at step {step}")

  # Killed after step 5 (mid-round for every phased case, checkpoints at 2 and 4), then resumed.
  stop = engine_config(case, stop_at_step=5, **{"checkpoint.every": 4})
  Trainer(stop, tmp_path / "resumed", devices=_devices(case)).run()
  assert not (tmp_path / "resumed" / "summary.json").exists()
  resumed = Trainer(engine_config(case, **{"checkpoint.every": 4}), tmp_path / "resumed",
                    devices=_devices(case))
  again, resumed_final = testing.run_to_end(resumed)
  for a, b in zip(jax.tree.leaves(whole_final.state), jax.tree.leaves(resumed_final.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert whole_final.data_state == resumed_final.data_state
  assert again["final_eval_loss"] == summary["final_eval_loss"]
  assert again["bytes_sent_per_worker"] == summary["bytes_sent_per_worker"]
  strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s", "mfu")}
                        for r in rows]
  assert strip(read_metrics(tmp_path / "resumed")) == strip(read_metrics(whole.workdir))
  on_disk = json.loads((whole.workdir / "summary.json").read_text(),
                       parse_constant=lambda name: pytest.fail(f"summary.json holds {name}"))
  assert (
    on_disk["gradients"] == engine_config(case).gradients and on_disk["refused_outer_steps"] == 0
  )


# One device (M replicas vmapped) against the 8-device mesh (one replica per slice, or data parallel
# over 8 devices); the pipeline on its (replica, stage) grid with fixed routing against the same
# algorithm on whole models (replicas source), since both average each replica's micro-batch losses;
# SkipPipe on identity paths against the replicas source, since each micro-batch then runs the whole
# model.
MESHES = {
    "dp": ({"mesh.data": 8, "data.batch_size": 8, "eval.batch_size": 8}, {"data.batch_size": 8}),
    "diloco": ({"mesh.replica": 2, "mesh.data": 4}, {}),
    "streaming_diloco": ({"mesh.replica": 2, "mesh.data": 4}, {}),
    "sparseloco": ({"mesh.replica": 2, "mesh.data": 4}, {}),
    "noloco": ({"mesh.replica": 4, "mesh.data": 2}, {}),
    "skippipe": ({"mesh.data": 4}, {}),
    "pipeline_noloco": ({"pipeline.routing": "fixed"}, {"gradients": "replicas", "mesh.replica": 1,
                                                        "mesh.stage": 1}),
    "pipeline_diloco": ({"pipeline.routing": "fixed"}, {"gradients": "replicas", "mesh.replica": 1,
                                                        "mesh.stage": 1}),
    "pipeline_sparseloco": ({"pipeline.routing": "fixed"},
                            {"gradients": "replicas", "mesh.replica": 1,
                                                            "mesh.stage": 1}),
    "skippipe_sparseloco": ({"mesh.replica": 2}, {"gradients": "replicas"}),
}


# Beside every case, DiLoCo's replicas on their own mesh axis with the accelerators' attention on
# 128-token windows: its TPU branch (flash attention) is traced inside the replicas' shard_map and
# must type its result as the XLA branch (which runs here) does.
MESH_ROWS = [(case, {}) for case in CASES] + [
    ("diloco", {"model.attention": "dot_product", "data.seq_len": 128})]


@pytest.mark.parametrize("case, extra", MESH_ROWS,
                         ids=[case + "".join(f",{k}={v}" for k, v in x.items())
                              for case, x in MESH_ROWS])
def test_one_device_equals_the_mesh(case, extra, tmp_path, tmp_path_factory):
  on_mesh, alone = MESHES[case]
  a = Trainer(engine_config(case, **on_mesh, **extra), tmp_path / "mesh")
  if alone or extra or case in ONE_DEVICE:
    b = Trainer(engine_config(case, **alone, **extra), tmp_path / "one", devices=jax.devices()[:1])
    summary_b, b_final = testing.run_to_end(b)
  else:  # the golden test's run: the same config on one device
    b, summary_b, b_final = _whole(tmp_path_factory, case)
  sent_b = summary_b["bytes_sent_per_worker"]
  seq_len = a.config.data.seq_len
  chain = testing.tiny_chain_of_sums(seq_len, a.config.data.batch_size * seq_len)
  summary_a, a_final = testing.run_to_end(a)
  sent_a = summary_a["bytes_sent_per_worker"]
  # The replicas' exchange moves the same bytes either way; dp's bytes are the data axis's gradient
  # all-reduce, which one device does not run, and the pipeline's ledger counts per device.
  assert a.config.algorithm == "dp" or a.config.gradients == "pipeline" or sent_a == sent_b
  ra, rb = read_metrics(a.workdir), read_metrics(b.workdir)
  assert [x["step"] for x in ra] == [y["step"] for y in rb] == list(range(1, 7))
  # A mesh sums in other orders than one device: within the chain of sums' bound per step run.
  for x, y in zip(ra, rb):
    for name in ("loss", "grad_norm"):
      testing.assert_within(x[name], y[name],
                            testing.trajectory_error_bound(y[name], y["step"], chain),
                            f"{name} at step {y['step']}")
  first = lambda t, final: jax.tree.leaves(jax.device_get(t.source.eval_params(final.state)))[0]
  first_a, first_b = first(a, a_final), first(b, b_final)
  testing.assert_within(first_a, first_b,
                        testing.trajectory_error_bound(first_b, a.config.num_steps, chain),
                        "first parameter leaf")


# dp and SkipPipe with dp exchange nothing; SkipPipe with SparseLoCo runs the replicas source's
# program (its bytes equal that source's: test_one_device_equals_the_mesh, case sparseloco here).
@pytest.mark.parametrize("case",
                         [c for c in CASES if c not in ("dp", "skippipe", "skippipe_sparseloco")])
def test_ledger_bytes_equal_the_collectives_of_the_compiled_program(case, tmp_path):
  # One replica per device and nothing else on the mesh, so every collective is the engine's.
  on_mesh = (
    {} if case.startswith("pipeline") else {"mesh.replica": engine_config(case).num_replicas}
  )
  # NoLoCo's outer program holds one exchange per grouping, of which one runs: with one grouping
  # the program's collectives are the step's (test_noloco_trainer checks each branch's against it).
  one_grouping = {"noloco.num_groupings": 1} if case.endswith("noloco") else {}
  trainer = Trainer(engine_config(case, **on_mesh, **one_grouping), tmp_path)
  state = trainer.init_state()
  for step in (1, ENGINE_CASES[case]["sync"]):
    route = trainer.source.route_at(step)
    program, entries = trainer.program(trainer.algorithm.phase_at(step), state, route)
    # Scalars of the metrics (the pipeline's loss and grad norm summed over stages) are not traffic
    # the ledger models: collectives under 64 bytes are left out.
    # An all-gather's result holds every worker's operand (one replica per device here).
    operand = lambda line: collective_bytes(line) // (
        trainer.config.num_replicas if "all-gather" in line else 1)
    compiled = sum(b for b in map(operand, hlo.collectives(program.as_text())) if b >= 64)
    # Each ledger entry's payload is one worker's operand, recorded where the collective is issued:
    # the pipeline's `comm.permute` records one entry per distinct non-empty permutation, as its
    # program holds one permute per such permutation (a `lax.switch` over the ticks).
    expected = sum(e.payload_bytes for e in entries)
    assert compiled == expected, (step, entries)
    assert step != ENGINE_CASES[case]["sync"] or expected > 0


@pytest.mark.parametrize("case", ["dp", "noloco", "pipeline_noloco"])
def test_a_huge_learning_rate_never_reaches_the_global_model(case, tmp_path):
  huge = {"optimizer.learning_rate": 1e30, "optimizer.warmup_steps": 0, "num_steps": 3,
          "log_every": 1, "checkpoint.every": 3}
  sync = {"noloco.sync_every": 1}
  with pytest.raises(codecs.NonFiniteError, match="held NaN or inf"):
    Trainer(engine_config(case, **huge, **sync), tmp_path / "raise", devices=_devices(case)).run()
  trainer = Trainer(engine_config(case, nonfinite="skip", **huge, **sync), tmp_path / "skip",
                    devices=_devices(case))
  summary, trainer_final = testing.run_to_end(trainer)
  assert summary["refused_outer_steps"] >= 1
  model = jax.device_get(trainer.source.eval_params(trainer_final.state))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(model))
  json.loads((tmp_path / "skip" / "summary.json").read_text(),
             parse_constant=lambda name: pytest.fail(f"summary.json holds {name}"))


BAD = {
    "gradients": ({"gradients": "tensor"}, "gradients must be one of"),
    "pipeline_stage_mesh": ({**ENGINE_CASES["pipeline_noloco"]["config"], "mesh.stage": 1},
                            "mesh.stage must be pipeline.num_stages=2"),
    "pipeline_slots": ({**ENGINE_CASES["pipeline_noloco"]["config"], "pipeline.slots_per_step": 3},
                       "pipeline.slots_per_step must be >= 1 and a divisor"),
    "pipeline_routing": ({**ENGINE_CASES["pipeline_noloco"]["config"], "pipeline.routing": "any"},
                         "pipeline.routing must be random or fixed"),
    "skippipe_paths": ({**ENGINE_CASES["skippipe"]["config"], "skippipe.paths": "0-1-7,0-2-3"},
                       "skippipe.paths=.* micro-batch 0 visits stage 7"),
    "skippipe_batch": ({**ENGINE_CASES["skippipe"]["config"],
                        "skippipe.paths": "0-1-2,0-2-3,0-3-1"},
                       "data.batch_size must be a multiple of the 3 skippipe.paths"),
    "nonfinite": ({"nonfinite": "ignore"}, "nonfinite must be raise or skip"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_refused_before_anything_is_written(name, tmp_path):
  changes, message = BAD[name]
  earlier = tmp_path / "run"
  earlier.mkdir()
  (earlier / "notes.txt").write_text("an earlier run's file")
  before = tree_hash(earlier)
  with pytest.raises(ValueError, match=message):
    Trainer(engine_config("dp", **changes), earlier)
  assert tree_hash(earlier) == before


def test_an_algorithm_is_reached_only_through_its_entry(tmp_path, monkeypatch):
  """train.validation and the Trainer know an algorithm only by its entry in algorithms.ALGORITHMS
  (builder + check_config), never by its name: an entry added under a new name has its own check
  called before anything is written, and trains exactly like the builder it reuses."""

  def check(c):
    checks.require(c.optimizer.name == "sgd", "optimizer.name", "sgd for algorithm=dp_sgd",
                   c.optimizer.name)

  monkeypatch.setitem(algorithms.ALGORITHMS, "dp_sgd",
                      algorithms.Algorithm(algorithms.ALGORITHMS["dp"].build, check))
  with pytest.raises(ValueError,
                     match="optimizer.name must be sgd for algorithm=dp_sgd, got 'adamw'"):
    Trainer(engine_config("dp", algorithm="dp_sgd"), tmp_path / "refused")
  assert not (tmp_path / "refused").exists()
  finals = []
  for name in ("dp_sgd", "dp"):
    trainer = Trainer(engine_config("dp", algorithm=name, num_steps=2, **{"optimizer.name": "sgd"}),
                      tmp_path / name, devices=jax.devices()[:1])
    _, trainer_final = testing.run_to_end(trainer)
    finals.append(jax.device_get(trainer_final.state.params))
  for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1]), strict=True):
    np.testing.assert_array_equal(a, b)


def test_two_processes_equal_one(tmp_path):
  """DiLoCo, Streaming DiLoCo (P=2, τ=1, α=0.5), NoLoCo and SparseLoCo (P=2, τ=1, α=0.5), each
  across two real processes (jax.distributed, gloo on 127.0.0.1; one replica per process; all four
  in one launch), end with every replica's parameters equal to the one-device run's (dp has one
  replica: nothing to split) and the same bytes in the ledger. Streaming DiLoCo and SparseLoCo
  (τ = 1) run their fragments' exchange on the overlap thread in both
  (outer.overlap_executor=auto). The reference compiles with XLA's expensive passes off, as the
  launched processes do; still not bit for bit, since one device runs the replicas' matmuls batched
  under vmap, which rounds differently from one replica per device: measured at most 2.4e-7 (2
  float32 ULPs at 1). SparseLoCo's top-k picks the same entries in both (a pick that flipped on a
  near-tie would move a parameter by a whole kept value, far above the bound): measured 1.2e-7."""
  proc = launch_script(2, [f"--out={tmp_path}"],
                       script=ROOT / "tests" / "engine_processes_worker.py")
  assert proc.returncode == 0, proc.stderr[-3000:]
  executors = {**{case: "inline" for case in PROCESS_CASES},
               "streaming_diloco": "thread", "sparseloco": "thread"}
  reported = re.findall(r"(\w+): done, overlap executor (\w+)", proc.stdout)  # by both processes
  assert sorted(reported) == sorted(2 * list(executors.items())), proc.stdout[-3000:]
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    for case in PROCESS_CASES:
      multi = np.load(tmp_path / f"{case}.npz")
      one = Trainer(process_leg_config(case), tmp_path / f"{case}_one", devices=jax.devices()[:1])
      summary, one_final = testing.run_to_end(one)
      assert one.overlap_executor == executors[case]
      sent = json.loads((tmp_path / case / "summary.json").read_text())["bytes_sent_per_worker"]
      assert sent == summary["bytes_sent_per_worker"] and sent["total"] > 0, case
      leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(one_final.state.params))[0]
      assert sorted(multi.files) == sorted(jax.tree_util.keystr(k) for k, _ in leaves)
      diff = max(float(np.max(np.abs(multi[jax.tree_util.keystr(k)] - v))) for k, v in leaves)
      print(f"{case}: 2 processes vs one device, max abs diff of the parameters {diff:.3g}")
      assert diff < 1e-6, case
  finally:
    jax.config.update("jax_disable_most_optimizations", previous)
