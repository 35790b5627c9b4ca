"""model.attention = "cpu_kernel": the fused C++ attention kernel against the XLA path it
replaces."""

import ctypes
import hashlib
import os
import pathlib
import re
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax import models, testing
from lowcomm_jax.cpu_kernels import attention as cpu_attention, build
from lowcomm_jax.models import llama
from lowcomm_jax.testing import read_metrics, tiny_config, tree_hash
from lowcomm_jax.train import Trainer


def _kernel_bhtk(q, k, v):
  """The kernel ([B, T, H, K]) on llama.causal_attention's [B, H, T, K] operands."""
  swap = lambda x: jnp.swapaxes(x, -3, -2)
  return swap(cpu_attention.causal_attention(swap(q), swap(k), swap(v)))


def _value_and_grads(attention, q, k, v, w):
  return jax.jit(
    jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v) * w), argnums=(0, 1, 2))
  )(q, k, v)


# Every compiled head width; T a multiple of the kernel's 4-row block or not (padded), 1 and long.
@pytest.mark.parametrize("shape", [(2, 2, 12, 16), (3, 2, 13, 32), (1, 1, 1, 32), (1, 1, 5, 64),
                                   (2, 1, 7, 128), (1, 2, 130, 32)])
def test_output_and_gradients_match_the_xla_attention(shape):
  q, k, v, w = (
    jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(shape[2]), 4)
  )
  ref_out = llama.causal_attention(q, k, v)
  out = jax.jit(_kernel_bhtk)(q, k, v)
  t = shape[2]
  out_bound = testing.attention_error_bound(q, k, t, ref_out)
  testing.assert_within(out, ref_out, out_bound, "output")
  (ref_loss, ref_grads), (loss, grads) = (_value_and_grads(f, q, k, v, w)
                                          for f in (llama.causal_attention, _kernel_bhtk))
  # Σ out·w: each output's error weighted by |w|, then the sum's own rounding over all its terms.
  testing.assert_within(
    loss,
    ref_loss,
    float(np.sum(np.abs(w))) * out_bound
    + testing.sum_error_bound(np.sum(np.abs(np.asarray(ref_out) * np.asarray(w))), w.size),
    "loss",
  )
  for name, g, ref in zip("qkv", grads, ref_grads):
    # the backward sums S (dV, dK) or S then K (dQ) more products of the forward's magnitudes
    testing.assert_within(g, ref, testing.attention_error_bound(q, k, t, ref) * t, f"d{name}")
  # causal: the first query sees only the first key (weight exp(0) / 1 = 1): v's first row, to
  # the rounding of that product
  testing.assert_within(out[..., 0, :], v[..., 0, :],
                        testing.operation_error_bound(np.abs(v[..., 0, :]), 2))


def test_vmap_over_a_stacked_axis_equals_the_slices_one_by_one():
  shape = (2, 2, 16, 16)
  q, k, v = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(7), 3))
  qs = jnp.stack([q, 2 * q, -q])  # batched q, unbatched k and v (broadcast by the vmap rule)
  batched = jax.jit(jax.vmap(_kernel_bhtk, in_axes=(0, None, None)))(qs, k, v)
  for i in range(3):
    np.testing.assert_array_equal(batched[i], _kernel_bhtk(qs[i], k, v))  # one kernel per slice
  grad = jax.vmap(jax.grad(lambda q: jnp.sum(_kernel_bhtk(q, k, v) ** 2)))(qs)
  ref = jax.vmap(jax.grad(lambda q: jnp.sum(llama.causal_attention(q, k, v) ** 2)))(qs)
  for i in range(3):  # dQ: S then K more sums of the forward's magnitudes (d_out = 2·out here)
    testing.assert_within(grad[i], ref[i], testing.attention_error_bound(qs[i], k, 16, ref[i]) * 16,
                          f"dq {i}")


def _assert_same_losses(rows, reference_rows):
  """The kernel's attention sums in another order than XLA's: each step's loss within the tiny
  model's chain-of-sums bound (tiny_config: 8 windows of 64 bytes)."""
  chain = testing.tiny_chain_of_sums(64, 8 * 64)
  for a, b in zip(rows, reference_rows, strict=True):
    testing.assert_within(a["loss"], b["loss"],
                          testing.trajectory_error_bound(b["loss"], b["step"], chain),
                          f"loss at step {b['step']}")


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_trainer_on_eight_devices_matches_the_xla_path_without_gathering_the_batch(tmp_path):
  kernel = Trainer(tiny_config(num_steps=4, **{"model.attention": "cpu_kernel"}),
                   tmp_path / "kernel")
  xla = Trainer(tiny_config(num_steps=4), tmp_path / "xla")
  kernel.run()
  xla.run()
  _assert_same_losses(read_metrics(tmp_path / "kernel"), read_metrics(tmp_path / "xla"))
  compiled = kernel.program(None, kernel.init_state())[0].as_text()
  # The batch is split over mesh.data = 8: each device's custom call holds its own sequence
  # (custom_partitioning), where a bare custom call would be all-gathered to [.., 8, 64, heads, 16].
  calls = [
    line for line in compiled.splitlines() if 'custom_call_target="lowcomm_attention' in line
  ]
  heads, t, k = 2, 64, 16
  assert len(calls) == 2 * 2  # forward and backward of each of the 2 layers
  assert all(f"f32[1,1,{t},{heads},{k}]" in line for line in calls)
  assert "all-gather" not in compiled
  # No [B, H, T, T] score or probability tensor is left in the step: that is the kernel's point.
  assert not re.search(rf"f32\[[\d,]*{heads},{t},{t}\]", compiled)
  assert re.search(rf"f32\[[\d,]*{heads},{t},{t}\]",
                   xla.program(None, xla.init_state())[0].as_text())


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_diloco_one_replica_per_device_slice_matches_the_xla_path(tmp_path):
  diloco = {"num_steps": 4, "algorithm": "diloco", "num_replicas": 2, "outer.sync_every": 2,
            "mesh.replica": 2, "mesh.data": 1}
  runs = {}
  for name, attention in (("kernel", "cpu_kernel"), ("xla", "xla")):
    Trainer(tiny_config(**diloco, **{"model.attention": attention}), tmp_path / name,
            devices=jax.devices()[:2]).run()
    runs[name] = read_metrics(tmp_path / name)
  _assert_same_losses(runs["kernel"], runs["xla"])


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_bad_values_are_named_before_anything_is_written(tmp_path):
  with pytest.raises(ValueError,
                     match=r"model.attention must be one of \('xla', 'dot_product', "
                           r"'cpu_kernel'\), got 'flash'"):
    models.get_model_config("tiny", attention="flash")
  (tmp_path / "run").mkdir()
  Trainer(tiny_config(num_steps=2), tmp_path / "run").run()
  before = tree_hash(tmp_path / "run")
  with pytest.raises(ValueError, match=r"model.attention='cpu_kernel' computes in float32 only"):
    Trainer(tiny_config(**{"model.attention": "cpu_kernel", "model.dtype": "bfloat16"}),
            tmp_path / "run")
  with pytest.raises(ValueError, match=r"supports head_dim .* in \(16, 32, 64, 128\), got 8"):
    models.get_model_config("tiny", num_heads=4, attention="cpu_kernel")
  assert tree_hash(tmp_path / "run") == before


def test_missing_compiler_is_a_clear_error(monkeypatch):
  monkeypatch.setenv("PATH", "/nonexistent")
  monkeypatch.delenv("CXX", raising=False)
  with pytest.raises(RuntimeError, match=r"model.attention='cpu_kernel' needs a C\+\+ compiler"):
    build.compiler("model.attention='cpu_kernel'")


def test_nan_propagates_as_in_the_xla_attention():
  # Built without -ffast-math: a NaN in q poisons its own query row, a NaN in k the rows that see
  # it (t >= s); the causal mask hides it from earlier rows. Same places as the XLA path.
  shape = (2, 2, 9, 16)
  q, k, v, w = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(3), 4))
  q, k = q.at[0, 0, 3, 5].set(jnp.nan), k.at[1, 1, 5, 0].set(jnp.nan)
  out, ref = jax.jit(_kernel_bhtk)(q, k, v), llama.causal_attention(q, k, v)
  nan_rows = np.zeros(shape[:3], bool)
  nan_rows[0, 0, 3], nan_rows[1, 1, 5:] = True, True
  np.testing.assert_array_equal(np.isnan(out).any(-1), nan_rows)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
  clean = lambda x: np.where(nan_rows[..., None], 0, x)
  testing.assert_within(clean(out), clean(ref),
                        testing.attention_error_bound(clean(q), clean(k), 9, clean(ref)))
  for g, g_ref in zip(_value_and_grads(_kernel_bhtk, q, k, v, w)[1],
                      _value_and_grads(llama.causal_attention, q, k, v, w)[1]):
    # the two backwards reach a NaN by other formulas (rowsum(dO ⊙ O) against rowsum(P ⊙ dP)), so
    # compare per (batch, head) slice: NaN in the poisoned slices, the others clean and equal
    poisoned = np.isnan(g).any(axis=(-2, -1))
    np.testing.assert_array_equal(poisoned, [[True, False], [False, True]])
    np.testing.assert_array_equal(poisoned, np.isnan(g_ref).any(axis=(-2, -1)))
    testing.assert_within(g[0, 1], g_ref[0, 1],
                          testing.attention_error_bound(q[0, 1], k[0, 1], 9, g_ref[0, 1]) * 9)


_SOURCE = pathlib.Path(cpu_attention.__file__).with_name("attention.cc")


def _plant(tmp_path, monkeypatch, library=b"\x7fELF planted", record=None, folder_mode=0o700):
  """A cache folder holding a file under the kernel's library name and, unless record is False, a
  hash record (the library's own SHA-256 unless given)."""
  monkeypatch.setenv("LOWCOMM_JAX_CACHE", str(tmp_path / "cache"))
  (tmp_path / "cache").mkdir(mode=0o700)
  path = build.library_path(_SOURCE)
  path.write_bytes(library)
  path.chmod(0o700)
  if record is not False:
    path.with_name(path.name + ".sha256").write_text(record or hashlib.sha256(library).hexdigest())
  (tmp_path / "cache").chmod(folder_mode)
  return path


@pytest.mark.parametrize("record, match", [
    ("0" * 64, r"has SHA-256 [0-9a-f]+…, its record says 0000000000000000…; refusing to load it"),
    (False, r"has no hash record"),
])
def test_a_library_without_its_recorded_hash_is_refused(tmp_path, monkeypatch, record, match):
  path = _plant(tmp_path, monkeypatch, record=record)
  with pytest.raises(build.KernelCacheError, match=match):
    build.build(_SOURCE, "model.attention='cpu_kernel'")
  assert path.read_bytes() == b"\x7fELF planted"  # refused, neither loaded nor replaced


def test_a_cache_others_can_write_or_own_is_refused(tmp_path, monkeypatch):
  _plant(tmp_path, monkeypatch, folder_mode=0o770)
  with pytest.raises(build.KernelCacheError,
                     match=r"folder .*cache is writable by group or others \(mode 770\)"):
    build.build(_SOURCE, "model.attention='cpu_kernel'")
  (tmp_path / "cache").chmod(0o700)
  build.library_path(_SOURCE).chmod(0o702)
  with pytest.raises(build.KernelCacheError, match=r"library .* is writable by group or others"):
    build.build(_SOURCE, "model.attention='cpu_kernel'")
  build.library_path(_SOURCE).chmod(0o700)
  build.build(_SOURCE, "model.attention='cpu_kernel'")  # its own hash, private: accepted
  # Another user's folder: chown it away (as root), or be another user than its owner.
  if os.geteuid() == 0:
    os.chown(tmp_path / "cache", 65534, 65534)
  else:
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(tmp_path / "cache").st_uid + 1)
  with pytest.raises(build.KernelCacheError,
                     match=r"folder .*cache belongs to uid \d+, not to this user"):
    build.build(_SOURCE, "model.attention='cpu_kernel'")


def test_the_cache_key_holds_the_cpu_feature_flags(monkeypatch):
  identity = build.cpu_identity()
  if pathlib.Path("/proc/cpuinfo").exists():
    assert re.search(r"^flags: \S+", identity, re.M), identity
  path = build.library_path(_SOURCE)
  monkeypatch.setattr(build, "cpu_identity", lambda: identity.replace("flags: ", "flags: avx512f "))
  assert build.library_path(_SOURCE) != path
  assert "-ffast-math" not in build.FLAGS


def test_a_fresh_build_records_its_hash_and_loads(tmp_path, monkeypatch):
  monkeypatch.setenv("LOWCOMM_JAX_CACHE", str(tmp_path / "cache"))
  library = build.build(_SOURCE, "model.attention='cpu_kernel'")
  assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700
  record = library.with_name(library.name + ".sha256").read_text().strip()
  assert record == hashlib.sha256(library.read_bytes()).hexdigest()
  assert ctypes.CDLL(str(library)).LowcommAttentionForward
