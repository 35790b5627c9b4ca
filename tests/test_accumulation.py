"""optimizer.accumulation_steps: k micro-batches of B/k rows give the step of one batch of B
rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax.models import config as model_config, decode, llama, loss as loss_lib
from lowcomm_jax.testing import engine_config
from lowcomm_jax.train import Trainer

EPS = 2.0**-23


def _batch(rows, seq_len, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (rows, seq_len + 1)).astype(np.int32)


def test_micro_batches_give_the_gradient_of_the_whole_batch():
  cfg = model_config.PRESETS["tiny"]
  params = llama.init_params(cfg, 0)
  graphdef = decode.graphdef_of(cfg)
  loss_and_grads = jax.value_and_grad(lambda p, b: loss_lib.lm_loss(graphdef, p, b))
  batch = jnp.asarray(_batch(8, 32))
  loss, grads = jax.jit(loss_and_grads)(params, batch)
  for k in (4,):
    acc_loss, acc_grads = jax.jit(loss_lib.accumulate(loss_and_grads, k))(params, batch)
    # The loss and each gradient entry are means over n = 8·32 token terms, summed in another
    # order (per micro-batch, then over micro-batches): they differ by at most n·ε times the
    # terms' scale, for which each leaf's largest entry stands (entries near zero by cancellation
    # get the leaf's scale, not their own).
    n = batch.shape[0] * (batch.shape[1] - 1)
    np.testing.assert_allclose(acc_loss, loss, rtol=n * EPS)
    for got, want in zip(jax.tree.leaves(acc_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(got, want, rtol=0, atol=n * EPS * float(jnp.abs(want).max()))
  assert loss_lib.accumulate(loss_and_grads, 1) is loss_and_grads


# Each gradient source that takes a batch per replica (the pipeline splits its batches by
# pipeline.slots_per_step and refuses accumulation): replicas side by side (every algorithm, dp
# included, receives its gradients from this source; the test above checks its gradient function),
# and SkipPipe's paths. Inner SGD: the step is linear in the gradients, so a rounding-level
# gradient difference stays rounding-level.
CASES = ["diloco", "skippipe"]


def _params_after(case, accumulation, workdir, steps=1):
  config = engine_config(case, **{"optimizer.name": "sgd", "optimizer.warmup_steps": 0,
                                  "data.batch_size": 8,
                                  "optimizer.accumulation_steps": accumulation})
  trainer = Trainer(config, workdir)  # builds the programs only; nothing is written
  state = trainer.init_state()
  m = config.num_replicas
  for step in range(1, steps + 1):
    batch = jax.device_put(np.stack([_batch(8, config.data.seq_len, seed=10 * step + r)
                                     for r in range(m)]), trainer.batch_sharding())
    program, _ = trainer.program(trainer.algorithm.phase_at(step), state,
                                 trainer.source.route_at(step))
    state, metrics = program(state, batch)
  return jax.device_get(state.params), np.asarray(metrics["loss"])


@pytest.mark.parametrize("case", CASES)
def test_accumulated_steps_equal_whole_batch_steps(case, tmp_path):
  whole, whole_loss = _params_after(case, 1, tmp_path / "whole")
  # 2 micro-batches of 4 rows: SkipPipe's 4 paths take one row each
  accumulated, acc_loss = _params_after(case, 2, tmp_path / "accumulated")
  # An SGD step of lr ≤ 3e-3 on gradients that differ by n·ε·|g| (n = 8·32 tokens); parameters are
  # O(1) at most, so the difference stays within a few ulps of their magnitude.
  n = 8 * 32
  np.testing.assert_allclose(acc_loss, whole_loss, rtol=n * EPS)
  for got, want in zip(jax.tree.leaves(accumulated), jax.tree.leaves(whole)):
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=16 * EPS * max(float(np.abs(want).max()), 1.0))
