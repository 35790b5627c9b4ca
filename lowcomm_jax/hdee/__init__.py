"""lowcomm_jax.hdee."""
