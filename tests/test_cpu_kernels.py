"""model.attention = "cpu_kernel": the fused C++ attention kernel against the XLA path it replaces."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax import models
from lowcomm_jax.cpu_kernels import attention as cpu_attention
from lowcomm_jax.cpu_kernels import build
from lowcomm_jax.models import llama
from lowcomm_jax.testing import read_metrics, tiny_config, tree_hash
from lowcomm_jax.train import Trainer


def _kernel_bhtk(q, k, v):
  """The kernel ([B, T, H, K]) on llama.causal_attention's [B, H, T, K] operands."""
  swap = lambda x: jnp.swapaxes(x, -3, -2)
  return swap(cpu_attention.causal_attention(swap(q), swap(k), swap(v)))


def _value_and_grads(attention, q, k, v, w):
  return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)


# Every compiled head width; T a multiple of the kernel's 4-row block or not (padded), 1 and long.
@pytest.mark.parametrize("shape", [(2, 2, 12, 16), (3, 2, 13, 32), (1, 1, 1, 32), (1, 1, 5, 64),
                                   (2, 1, 7, 128), (1, 2, 130, 32)])
def test_output_and_gradients_match_the_xla_attention(shape):
  q, k, v, w = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(shape[2]), 4))
  ref_out = llama.causal_attention(q, k, v)
  out = jax.jit(_kernel_bhtk)(q, k, v)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  (ref_loss, ref_grads), (loss, grads) = (_value_and_grads(f, q, k, v, w)
                                          for f in (llama.causal_attention, _kernel_bhtk))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, ref in zip(grads, ref_grads):
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(ref)))))
  # causal: the first query sees only the first key, so its output is v's first row exactly
  np.testing.assert_allclose(out[..., 0, :], v[..., 0, :], rtol=1e-6)


def test_vmap_over_a_stacked_axis_equals_the_slices_one_by_one():
  shape = (2, 2, 16, 16)
  q, k, v = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(7), 3))
  qs = jnp.stack([q, 2 * q, -q])  # batched q, unbatched k and v (broadcast by the vmap rule)
  batched = jax.jit(jax.vmap(_kernel_bhtk, in_axes=(0, None, None)))(qs, k, v)
  for i in range(3):
    np.testing.assert_allclose(batched[i], _kernel_bhtk(qs[i], k, v), rtol=1e-6)
  grad = jax.vmap(jax.grad(lambda q: jnp.sum(_kernel_bhtk(q, k, v) ** 2)))(qs)
  ref = jax.vmap(jax.grad(lambda q: jnp.sum(llama.causal_attention(q, k, v) ** 2)))(qs)
  np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-5)


def test_trainer_on_eight_devices_matches_the_xla_path_without_gathering_the_batch(tmp_path):
  kernel = Trainer(tiny_config(num_steps=4, **{"model.attention": "cpu_kernel"}), tmp_path / "kernel")
  xla = Trainer(tiny_config(num_steps=4), tmp_path / "xla")
  kernel.run()
  xla.run()
  np.testing.assert_allclose([m["loss"] for m in read_metrics(tmp_path / "kernel")],
                             [m["loss"] for m in read_metrics(tmp_path / "xla")], rtol=2e-6)
  compiled = kernel.program(None, kernel.init_state())[0].as_text()
  # The batch is split over mesh.data = 8: each device's custom call holds its own sequence
  # (custom_partitioning), where a bare custom call would be all-gathered to [.., 8, 64, heads, 16].
  calls = [line for line in compiled.splitlines() if "custom_call_target=\"lowcomm_attention" in line]
  heads, t, k = 2, 64, 16
  assert len(calls) == 2 * 2  # forward and backward of each of the 2 layers
  assert all(f"f32[1,1,{t},{heads},{k}]" in line for line in calls)
  assert "all-gather" not in compiled
  # No [B, H, T, T] score or probability tensor is left in the step: that is the kernel's point.
  assert not re.search(rf"f32\[[\d,]*{heads},{t},{t}\]", compiled)
  assert re.search(rf"f32\[[\d,]*{heads},{t},{t}\]", xla.program(None, xla.init_state())[0].as_text())


def test_diloco_one_replica_per_device_slice_matches_the_xla_path(tmp_path):
  diloco = {"num_steps": 4, "algorithm": "diloco", "num_replicas": 2, "diloco.sync_every": 2,
            "mesh.replica": 2, "mesh.data": 1}
  runs = {}
  for name, attention in (("kernel", "cpu_kernel"), ("xla", "xla")):
    Trainer(tiny_config(**diloco, **{"model.attention": attention}), tmp_path / name,
            devices=jax.devices()[:2]).run()
    runs[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
  np.testing.assert_allclose(runs["kernel"], runs["xla"], rtol=2e-6)


def test_bad_values_are_named_before_anything_is_written(tmp_path):
  with pytest.raises(ValueError, match=r"model.attention must be one of \('xla', 'dot_product', 'cpu_kernel'\), got 'flash'"):
    models.get_model_config("tiny", attention="flash")
  (tmp_path / "run").mkdir()
  Trainer(tiny_config(num_steps=2), tmp_path / "run").run()
  before = tree_hash(tmp_path / "run")
  with pytest.raises(ValueError, match=r"model.attention='cpu_kernel' computes in float32 only"):
    Trainer(tiny_config(**{"model.attention": "cpu_kernel", "model.dtype": "bfloat16"}), tmp_path / "run")
  with pytest.raises(ValueError, match=r"supports head_dim .* in \(16, 32, 64, 128\), got 8"):
    models.get_model_config("tiny", num_heads=4, attention="cpu_kernel")
  assert tree_hash(tmp_path / "run") == before


def test_missing_compiler_is_a_clear_error(monkeypatch):
  monkeypatch.setenv("PATH", "/nonexistent")
  monkeypatch.delenv("CXX", raising=False)
  with pytest.raises(RuntimeError, match=r"model.attention='cpu_kernel' needs a C\+\+ compiler"):
    build.compiler("model.attention='cpu_kernel'")
