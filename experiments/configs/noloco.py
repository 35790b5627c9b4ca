"""NoLoCo: no all-reduce; every H steps random pairs of replicas average slow weights
(docs/algorithms.md §2.3).

  python experiments/train.py --config=experiments/configs/noloco.py --workdir=runs/noloco

Each replica i keeps fast weights θ_i, slow weights φ_i and an outer momentum δ_i. Every H inner
steps the M replicas split into random pairs drawn from `seed` (the same on every replica, so nobody
has to agree on anything at run time); a pair exchanges φ and Δ = φ − θ point to point
(`lax.ppermute`) and each member steps δ_i ← α·δ_i − β·mean(Δ) − γ·(φ_i − mean(φ)), φ_i ← φ_i + δ_i,
θ_i ← φ_i. There is no global model: `eval_loss` is the loss of the replicas' mean slow weights and
`eval_loss_replica_<i>` each replica's; `weight_spread` (RMS distance of the φ_i from their mean) is
logged at every outer step. Each worker sends 2 × 4 bytes per parameter per outer step to its one
peer, whatever M is.

Replicas are simulated on one device by default (`mesh.replica=1`); `--config.mesh.replica=4` puts
one replica on each of 4 devices (`jax.shard_map`, only collective-permutes in the compiled step).

Variants (`--config=experiments/configs/noloco.py:<variant>`):
- default / small: the `small` model, M = 4, H = 50, pairs, α = 0.5, β = γ = 0.7 (the paper's code),
  600 steps of 16 × 128 tokens per replica: final eval loss 1.70 (the replicas' mean), about
  9.5 CPU-minutes (a 2-core CPU; wall time depends on what else runs there).
- fp4: the same with outer gradients sent as e3m0 (4 bits and one scale per 1024 values).
- tiny: the `tiny` model, M = 4, H = 10, 200 steps.
"""

from lowcomm_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.default_config()
  c.algorithm = "noloco"
  c.num_replicas = 4
  c.mesh.data = 1
  c.noloco.group_size = 2
  c.noloco.outer_learning_rate = 0.7
  c.noloco.outer_momentum = 0.5
  c.noloco.gamma = 0.7
  if variant in ("", "default", "small", "fp4"):
    config_lib.override(c, config_lib.RUN_SIZES["small"])
    c.noloco.sync_every = 50
    if variant == "fp4":
      c.noloco.codec = "e3m0"
  elif variant == "tiny":
    config_lib.override(c, config_lib.RUN_SIZES["tiny"])
    c.noloco.sync_every = 10
  else:
    raise ValueError(f"config variant must be '', 'default', 'small', 'fp4' or 'tiny', "
                     f"got {variant!r}")
  return c
