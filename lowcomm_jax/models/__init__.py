"""lowcomm_jax.models."""
