"""Training along SkipPipe paths: zero gradients for skipped stages, swapped blocks, summed
micro-batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax import config as config_lib, testing
from lowcomm_jax.models import get_model_config, llama
from lowcomm_jax.models.loss import cross_entropy, lm_loss
from lowcomm_jax.optim.inner import make_optimizer
from lowcomm_jax.skippipe import training

# 3 stages of 2 layers each, so a stage's block has an inner order to keep.
STAGES, LPS = 3, 2

# Jitted once per module: eager scans compile their bodies on every call, which dominates the run
# time.
_summed_grads = jax.jit(training.summed_microbatch_grads, static_argnums=0)
_loss_and_grad = jax.jit(jax.value_and_grad(lm_loss, argnums=1), static_argnums=0)
_loss = jax.jit(lm_loss, static_argnums=0)


@pytest.fixture(scope="module")
def setup():
  cfg = get_model_config("tiny", num_layers=STAGES * LPS)
  opt = config_lib.override(config_lib.default_config(), {
      "optimizer.learning_rate": 1e-2, "optimizer.warmup_steps": 0, "optimizer.b2": 0.999,
      "optimizer.weight_decay": 0.0}).optimizer  # the reference's AdamW, clipped to 1.0
  tx = make_optimizer(opt, 10)
  graphdef, state = training.init_state(cfg, tx, seed=0)
  # Larger block weights than at init, so that the order of the blocks visibly changes the loss.
  params = dict(state.params, blocks=jax.tree.map(lambda a: 20 * a, state.params["blocks"]))
  batch = jax.random.randint(jax.random.key(1), (3, 2, 17), 0, 256)
  return cfg, tx, graphdef, params, batch


def test_layer_order_runs_each_stage_block_in_path_order():
  np.testing.assert_array_equal(training.layer_order(np.array([[0, 2, 1]]), 2),
                                [[0, 1, 4, 5, 2, 3]])
  np.testing.assert_array_equal(training.layer_order(jnp.array([[0, 1]]), 3), [[0, 1, 2, 3, 4, 5]])


def test_step_with_a_path_skipping_a_stage_leaves_its_layers_untouched(setup):
  cfg, tx, graphdef, params, batch = setup
  step = training.make_path_train_step(graphdef, tx, STAGES, LPS)
  # A copy, since the step donates its state and the fixture's arrays serve the other tests.
  own = jax.tree.map(jnp.array, params)
  state = training.TrainState(own, tx.init(own), jnp.zeros((), jnp.int32))
  before = jax.tree.map(np.array, params)
  # Stage 1 (layers 2, 3) is on no micro-batch's path; stage 2 is, once swapped.
  paths = np.array([[0, 2], [0, 2], [0, 2]])
  grads = _summed_grads(graphdef, params, batch, training.layer_order(paths, LPS))[1]
  for leaf in jax.tree.leaves(grads["blocks"]):
    assert np.all(leaf[2:4] == 0)
    assert np.all(np.abs(leaf[4:6]).reshape(2, -1).max(axis=1) > 0)
  new_state, metrics = step(state, batch, paths)
  for old, new in zip(jax.tree.leaves(before["blocks"]),
                      jax.tree.leaves(new_state.params["blocks"])):
    np.testing.assert_array_equal(new[2:4], old[2:4])  # zero gradient, zero Adam moments: no update
    assert not np.array_equal(new[4:6], old[4:6])
  assert metrics["mb_losses"].shape == (3,) and np.isfinite(float(metrics["loss"]))
  # One compiled program serves other paths of the same length.
  step(new_state, batch, np.array([[0, 1], [0, 2], [0, 1]]))
  assert step.jitted._cache_size() == 1


def _loss_bound(cfg, loss):
  """Two evaluations of a micro-batch's loss (16 tokens of 2 windows) that sum in other orders."""
  return testing.sum_error_bound(abs(float(loss)), testing.chain_of_sums(cfg, 16, 2 * 16))


def test_swapped_path_loss_equals_blocks_run_by_hand(setup):
  cfg, _, graphdef, params, batch = setup
  # Every micro-batch on the swapped path: the mean of the three path losses, checked per
  # micro-batch.
  mb_losses = _summed_grads(graphdef, params, batch,
                            training.layer_order(np.array([[0, 2, 1]] * 3), LPS))[2]
  loss, mb = mb_losses[0], batch[:1]
  model = nnx.merge(graphdef, params)
  block_def, blocks = nnx.split(model.blocks)
  tokens, targets = mb[0, :, :-1], mb[0, :, 1:]
  cos, sin = llama.rotary_tables(tokens.shape[1], cfg.head_dim, cfg.rope_base)
  x = jnp.take(model.embed[...], tokens, axis=0)
  for layer in (0, 1, 4, 5, 2, 3):  # stage 0, stage 2, stage 1: each stage's own layers in order
    x = nnx.merge(block_def, jax.tree.map(lambda a, i=layer: a[i], blocks))(x, cos, sin)
  by_hand = cross_entropy(model.final_norm(x) @ model.head[...], targets)
  testing.assert_within(float(loss), float(by_hand), _loss_bound(cfg, by_hand), "loss")
  in_order = _loss(graphdef, params, mb[0], None)
  # the bound tells orders apart
  assert abs(float(in_order) - float(by_hand)) > 10 * _loss_bound(cfg, by_hand)


def test_summed_gradient_equals_sum_of_per_microbatch_gradients(setup):
  cfg, _, graphdef, params, batch = setup
  paths = np.array([[0, 1, 2], [0, 2, 1], [0, 1, 2]])
  layer_paths = training.layer_order(paths, LPS)
  loss, grads, mb_losses = _summed_grads(graphdef, params, batch, layer_paths)
  separate = [_loss_and_grad(graphdef, params, batch[i], layer_paths[i]) for i in range(3)]
  expected = jax.tree.map(lambda *g: sum(g) / 3, *[g for _, g in separate])
  # gradients: the chain of sums forward and back, then the mean of 3, at each leaf's scale
  testing.assert_trees_within(grads, expected, lambda want: testing.sum_error_bound(
      np.max(np.abs(np.asarray(want))), 2 * testing.chain_of_sums(cfg, 16, 2 * 16) + 3), "gradient")
  for got, (want, _) in zip(mb_losses, separate):
    testing.assert_within(float(got), float(want), _loss_bound(cfg, want), "micro-batch loss")
  testing.assert_within(float(loss), np.mean(mb_losses),
                        testing.sum_error_bound(np.mean(np.abs(mb_losses)), 3),
                        "mean of 3")


def test_eval_with_stages_removed_runs_the_kept_stages_in_order(setup):
  cfg, _, graphdef, params, batch = setup
  evals = batch[None, 0]
  removed = training.stage_removal_losses(graphdef, params, evals, STAGES, LPS, num_removed=1)
  assert sorted(removed) == [(0, 1), (0, 2)]
  kept = float(_loss(graphdef, params, batch[0], jnp.array([0, 1, 4, 5])))
  testing.assert_within(removed[(0, 2)], kept, _loss_bound(cfg, kept), "stage 1 removed")
  whole = float(_loss(graphdef, params, batch[0], None))
  testing.assert_within(training.evaluate(graphdef, params, evals), whole, _loss_bound(cfg, whole),
                        "all stages")


@pytest.mark.parametrize("paths, message", [
    ([[0, 3, 1]], "visits stage 3, outside"),
    ([[0, -1]], "visits stage -1, outside"),
    ([[1, 0, 2]], "must start at stage 0"),
    ([[0, 1, 1]], "visits a stage twice"),
    ([[0, 1], [0, 1, 2]], "same length"),
    ([[0, 1], [0, 2]], "got 2 paths for a batch of 3"),
])
def test_bad_paths_raise_a_clear_error(setup, paths, message):
  _, tx, graphdef, params, batch = setup
  step = training.make_path_train_step(graphdef, tx, STAGES, LPS)
  state = training.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
  with pytest.raises(ValueError, match=f"stage_paths: .*{message}"):
    step(state, batch, paths)


def test_stage_split_that_does_not_match_the_model_is_rejected(setup):
  _, tx, graphdef, params, batch = setup
  step = training.make_path_train_step(graphdef, tx, num_stages=4, layers_per_stage=2)
  state = training.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
  with pytest.raises(ValueError, match="layers_per_stage"):
    step(state, batch, [[0, 1]] * 3)
  with pytest.raises(ValueError, match="keep_stages: must include stage 0"):
    training.kept_stage_path([1, 2], STAGES)
