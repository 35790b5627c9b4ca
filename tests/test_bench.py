"""benchmarks/bench.py: the `quick` scale end to end on two entries (score against a hand
computation from the runs' own summaries, resume, the README section), the beats/tie rule, and a
bad --entries refused in one line."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from lowcomm_jax import models, testing

ROOT = pathlib.Path(__file__).parent.parent
PATH = ROOT / "benchmarks" / "bench.py"

# (bandwidth bit/s, latency s) of each link, written out by hand.
LINKS = {"datacenter": (400e9, 0.0), "10 Gbit/s": (10e9, 0.0), "1 Gbit/s + 50 ms": (1e9, 0.05),
         "100 Mbit/s + 100 ms": (100e6, 0.1)}


@pytest.fixture(scope="module")
def bench():
  return testing.file_module(PATH, "bench_benchmark")


@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
  """dp and DiLoCo M=2, one seed each, at the quick scale; a README with the markers beside."""
  root = tmp_path_factory.mktemp("bench")
  results = root / "results"
  results.mkdir()
  (results / "README.md").write_text("before\n<!-- bench:quick -->\nold\n<!-- /bench:quick -->\n"
                                     "after\n")
  ran = bench.bench("quick", ["dp", "diloco_m2"], 1, root / "runs", results)
  return root, results, ran


def _hand_seconds(task, summary, curve, workers, syncs_of):
  """Steps to target × the declared step seconds + every ring all-reduce of float32 parameters
  issued in those steps, priced by hand, per link."""
  step_flops = models.flops_per_token(models.get_model_config(task.model), task.seq_len) * (
    task.batch * task.seq_len)
  step_seconds = step_flops / (task.mfu * task.peak_flops)
  steps = next(step for step, loss in curve if loss <= task.target_loss)
  payload = 4 * summary["num_params"]
  m = workers
  return steps, {link: steps * step_seconds + syncs_of(steps) * (
                   2 * (m - 1) / m * 8 * payload / bandwidth + 2 * (m - 1) * latency)
                 for link, (bandwidth, latency) in LINKS.items()}


def test_quick_scores_equal_a_hand_computation_from_the_runs_summaries(bench, quick):
  _, results, ran = quick
  assert ran == 2
  out = json.loads((results / "bench_quick.json").read_text())
  task = bench.TASKS["quick"]
  runs = {r["entry"]: r for r in out["runs"]}
  # dp: an all-reduce after every step but the last; DiLoCo: one after every H-th step.
  for entry, syncs_of, total_syncs in (("dp", lambda s: s - 1, task.steps),
                                       ("diloco_m2", lambda s: s // task.sync_every,
                                        task.steps // task.sync_every)):
    r = runs[entry]
    workdir = pathlib.Path(r["workdir"])
    summary = json.loads((workdir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    curve = [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    # The ledger's bytes are M = 2's ring of the float32 parameters per sync (a factor 1).
    assert summary["bytes_sent_per_worker"]["total"] == total_syncs * 4 * summary["num_params"]
    steps, expected = _hand_seconds(task, summary, curve, 2, syncs_of)
    assert r["steps_to_target"] == steps
    assert r["final_eval_loss"] == summary["final_eval_loss"]
    for link, seconds in expected.items():
      assert r["links"][link]["seconds"] == pytest.approx(seconds, rel=1e-9), (entry, link)
  # Fewer bytes win on a slow link: DiLoCo's 10× fewer syncs at the same steps to target.
  assert runs["diloco_m2"]["links"]["1 Gbit/s + 50 ms"]["seconds"] < (
    runs["dp"]["links"]["1 Gbit/s + 50 ms"]["seconds"])


def test_quick_writes_the_table_into_the_readme_and_a_rerun_runs_nothing(bench, quick):
  root, results, _ = quick
  readme = (results / "README.md").read_text()
  assert readme.startswith("before\n<!-- bench:quick -->\n") and readme.endswith(
    "<!-- /bench:quick -->\nafter\n")
  assert "\nold\n" not in readme and "| dp | 1 |" in readme and "| diloco_m2 | 1 |" in readme
  assert (results / "bench_quick.png").stat().st_size > 0
  before = (results / "bench_quick.json").read_text()
  metrics = sorted((root / "runs" / "quick").glob("*/metrics.jsonl"))
  stamps = [p.stat().st_mtime_ns for p in metrics]
  assert bench.bench("quick", ["dp", "diloco_m2"], 1, root / "runs", results) == 0
  assert json.loads((results / "bench_quick.json").read_text())["runs"] == (
    json.loads(before)["runs"])
  assert [p.stat().st_mtime_ns for p in metrics] == stamps


def test_dp_on_one_device_is_priced_as_its_two_sites(bench, quick, tmp_path):
  """With one accelerator at hand, dp trains its global batch on one device and the clock prices
  the all-reduce between its two sites as the two-device run's ledger does: the same bytes and the
  same simulated seconds at every evaluation."""
  one = bench.run_one(bench.TASKS["quick"], "dp", 0, tmp_path / "dp", devices=jax.devices()[:1])
  _, results, _ = quick
  two = next(r for r in json.loads((results / "bench_quick.json").read_text())["runs"]
             if r["entry"] == "dp")
  assert (one["ran_on"]["devices"], one["ran_on"]["priced_sites"]) == (1, 2)
  assert (two["ran_on"]["devices"], two["ran_on"]["priced_sites"]) == (2, None)
  assert one["bytes_per_worker"] == two["bytes_per_worker"] > 0
  assert one["peak_bytes_per_sync"] == two["peak_bytes_per_sync"]
  assert [s for s, _ in one["eval_curve"]] == [s for s, _ in two["eval_curve"]]
  assert one["curve_links"] == two["curve_links"]


def test_a_complete_workdir_is_scored_again_without_training_or_writing(bench, quick):
  """A run whose record is lost (another results folder, a merge) but whose workdir is complete
  gets the same record from the workdir alone: the ledger traced from the abstract state, the
  curve and the bytes as recorded, nothing in the workdir rewritten."""
  root, results, _ = quick
  recorded = next(r for r in json.loads((results / "bench_quick.json").read_text())["runs"]
                  if r["entry"] == "diloco_m2")
  workdir = pathlib.Path(recorded["workdir"])
  stamps = {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()}
  again = bench.run_one(bench.TASKS["quick"], "diloco_m2", 0, workdir)
  assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()} == stamps
  assert again["ran_on"]["complete_before_start"] and not recorded["ran_on"][
    "complete_before_start"]
  summary = json.loads((workdir / "summary.json").read_text())
  assert again["ran_on"]["train_seconds"] == summary["wall_time_s"]
  for key in ("eval_curve", "curve_links", "bytes_per_worker", "peak_bytes_per_sync",
              "final_eval_loss", "steps", "tokens"):
    assert json.loads(json.dumps(again[key])) == recorded[key], key


def test_beats_only_beyond_two_standard_errors(bench):
  # Means 1.0 and 2.0, standard errors 0.1/√3 each: the margin 2·√(2/300) = 0.163 < 1.
  assert bench.bench_report.compare([0.9, 1.0, 1.1], [1.9, 2.0, 2.1]) == "beats"
  assert bench.bench_report.compare([1.9, 2.0, 2.1], [0.9, 1.0, 1.1]) == "loses"
  # Means 1.0 and 1.3, standard errors 0.2/√3 each: margin 2·√(0.08/3) = 0.327 > 0.3.
  assert bench.bench_report.compare([0.8, 1.0, 1.2], [1.1, 1.3, 1.5]) == "tie"
  # ... and with spread 0.18 the margin is 0.294 < 0.3.
  assert bench.bench_report.compare([0.82, 1.0, 1.18], [1.12, 1.3, 1.48]) == "beats"
  # one seed: no standard error, no verdict
  assert bench.bench_report.compare([1.0], [5.0]) == "tie"


def test_a_sweep_records_each_point_reads_the_entrys_own_from_the_bench_and_resumes(quick,
                                                                                   tmp_path):
  """benchmarks/sweep.py on diloco_m2 at the quick scale, outer momentum 0.5 (the entry's own) and
  0.9: the first is bench.py's run read back, not trained; the second trains with that momentum;
  the best point is the lower loss; a rerun trains nothing."""
  sweep = testing.file_module(ROOT / "benchmarks" / "sweep.py", "sweep_benchmark")
  _, results, _ = quick
  grid = sweep.parse_grid("outer_optimizer.momentum=0.5,0.9")
  assert grid == {"outer_optimizer.momentum": [0.5, 0.9]}
  out = tmp_path / "diloco_m2.sweep_quick.json"
  assert sweep.sweep("quick", "diloco_m2", grid, 1, tmp_path / "runs", out, results) == 1
  record = json.loads(out.read_text())
  benched = next(r for r in json.loads((results / "bench_quick.json").read_text())["runs"]
                 if r["entry"] == "diloco_m2" and r["seed"] == 0)
  rows = {r["point"]["outer_optimizer.momentum"]: r for r in record["runs"]}
  assert rows[0.5]["final_eval_loss"] == benched["final_eval_loss"]
  assert rows[0.5]["workdir"] == benched["workdir"]
  trained = json.loads((pathlib.Path(rows[0.9]["workdir"]) / "config.json").read_text())
  assert trained["config"]["outer_optimizer"]["momentum"] == 0.9
  assert rows[0.9]["final_eval_loss"] != rows[0.5]["final_eval_loss"]
  best = min(rows, key=lambda m: rows[m]["final_eval_loss"])
  assert record["best"]["point"] == {"outer_optimizer.momentum": best}
  assert sweep.sweep("quick", "diloco_m2", grid, 1, tmp_path / "runs", out, results) == 0
  with pytest.raises(ValueError, match="unknown config key 'outer_optimizer.lr'"):
    sweep.check(sweep.bench.TASKS["quick"], "diloco_m2", sweep.parse_grid("outer_optimizer.lr=1"))


def test_a_bad_entry_is_refused_in_one_line_before_any_run(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run([sys.executable, str(PATH), "--entries=dp,diloco_m3",
                         f"--workdir={tmp_path / 'runs'}", f"--results_dir={tmp_path}"],
                        capture_output=True, text=True, env=env, timeout=120, check=False)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
  assert proc.stderr.startswith("--entries: no entry 'diloco_m3'; allowed: ")
  assert "diloco_m2" in proc.stderr and "Traceback" not in proc.stderr
  assert list(tmp_path.iterdir()) == []


def test_runs_on_another_corpus_are_not_mixed_into_a_results_file(bench, quick, tmp_path):
  """A results file whose runs trained on other text (another Python's stdlib) or did not record
  theirs is refused before any run, in one line naming --results_dir, and left as it was."""
  _, results, _ = quick
  here = json.loads((results / "bench_quick.json").read_text())
  assert {r["corpus_identity"] for r in here["runs"]} == {
      bench.corpora.corpus_identity(bench.TASKS["quick"].corpus)}
  for identity in ("0123456789abcdef", None):
    other = tmp_path / str(identity)
    other.mkdir()
    runs = [{**r, "corpus_identity": identity} for r in here["runs"]]
    (other / "bench_quick.json").write_text(json.dumps({**here, "runs": runs}))
    before = (other / "bench_quick.json").read_text()
    with pytest.raises(ValueError) as refused:
      bench.bench("quick", ["dp", "diloco_m2", "diloco_m4"], 1, tmp_path / "runs", other)
    message = str(refused.value)
    assert message.startswith("--results_dir: ") and "\n" not in message, message
    assert (identity or "unrecorded") in message
    assert (other / "bench_quick.json").read_text() == before
    assert sorted(p.name for p in other.iterdir()) == ["bench_quick.json"]
  assert not (tmp_path / "runs").exists()
