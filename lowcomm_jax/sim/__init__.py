"""lowcomm_jax.sim."""
