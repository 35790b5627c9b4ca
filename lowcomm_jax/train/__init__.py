"""lowcomm_jax.train."""
