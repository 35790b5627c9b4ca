"""NoLoCo's sync latency model against its own closed forms."""

import math

import pytest

from lowcomm_jax.sim import latency, network as net_lib


def test_param_counts_from_the_shapes():
  # 125M config: d 768, 12 layers, FFN 3072, vocab 128,002, untied.
  per_layer = 4 * 768**2 + 3 * 768 * 3072 + 2 * 768
  assert latency.NOLOCO_MODELS["125M"] == 12 * per_layer + 768 + 2 * 128_002 * 768
  assert latency.NOLOCO_MODELS["125M"] == 309_876_480
  assert latency.NOLOCO_MODELS["1.3B"] == 2_135_009_280
  assert latency.NOLOCO_MODELS["6.8B"] == 9_638_793_216
  tied = latency.llama_param_count(768, 12, 3072, tie_embeddings=True)
  assert latency.NOLOCO_MODELS["125M"] - tied == 128_002 * 768


def test_closed_forms():
  # 1e9 fp32 params = 32 Gbit per tensor; 1 Gbit/s, 50 ms: b = 32 s.
  net = net_lib.Network(1e9, 0.05)
  times = latency.sync_times(1e9, 16, net)
  assert times.pairwise == pytest.approx(0.05 + 2 * 32)
  assert times.ring == pytest.approx(2 * 15 / 16 * 32 + 2 * 15 * 0.05)
  assert times.tree == pytest.approx(2 * 4 * (0.05 + 32))
  bf16 = latency.sync_times(1e9, 16, net, bytes_per_param=2)
  assert bf16.pairwise == pytest.approx(0.05 + 32)


def test_pairwise_does_not_grow_with_workers():
  net = "internet"
  times = [latency.sync_times(1e8, n, net).pairwise for n in latency.WORKER_COUNTS]
  assert times == [times[0]] * len(times)


def test_speedup_over_tree_is_log2_n():
  # Bandwidth-dominated (6.8B at 100 Mbit/s): T_tree / T_pair -> log2 N.
  params = latency.NOLOCO_MODELS["6.8B"]
  for n in latency.WORKER_COUNTS:
    assert latency.speedup_over_tree(params, n, "100Mbit,50ms") == pytest.approx(
        math.log2(n), rel=1e-3)
  # The paper's headline: about 10x at 1024 workers, at both bandwidths.
  for spec in ("100Mbit,50ms", "1Gbit,50ms"):
    for params in latency.NOLOCO_MODELS.values():
      assert latency.speedup_over_tree(params, 1024, spec) == pytest.approx(10, rel=0.01)


def test_latency_dominated_speedup_is_twice_log2_n():
  # A tiny payload on a slow-latency link: 2 log2 N (l + b) / (l + 2b) -> 2 log2 N.
  speedup = latency.speedup_over_tree(1.0, 1024, net_lib.Network(1e12, 0.1))
  assert speedup == pytest.approx(20, rel=1e-6)


def test_table_rows():
  rows = latency.latency_table()
  assert len(rows) == 3 * 2 * len(latency.WORKER_COUNTS)
  assert latency.WORKER_COUNTS[0] == 8 and latency.WORKER_COUNTS[-1] == 4096
  row = next(r for r in rows if r["model"] == "1.3B" and r["workers"] == 1024
             and r["bandwidth_bits_per_s"] == 1e9)
  expected = latency.sync_times(latency.NOLOCO_MODELS["1.3B"], 1024, "1Gbit,50ms")
  assert row["tree_s"] == pytest.approx(expected.tree)
  assert row["speedup_vs_tree"] == pytest.approx(expected.tree / expected.pairwise)


@pytest.mark.processes  # starts a binary: not in the fast tier
def test_benchmark_prints_headline_and_writes_json(tmp_path):
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out_json = tmp_path / "sync_latency.json"
  out = subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "sync_latency.py"),
       f"--out={out_json}"],
      capture_output=True, text=True, check=True, cwd=root, timeout=120)
  assert "speed-up over tree all-reduce at N=1024: 10.00x to 10.03x" in out.stdout
  low, high = json.loads(out_json.read_text())["speedup_vs_tree_at_1024"]
  assert 9.9 < low <= high < 10.1
