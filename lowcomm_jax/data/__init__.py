"""lowcomm_jax.data."""
