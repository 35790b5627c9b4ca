"""lowcomm_jax.skippipe."""
