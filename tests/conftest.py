"""Strict JAX for every test: 8 simulated CPU devices, and no silent rank promotion.

(Strict dtype promotion would be stricter still, but optax's own Adam promotes a Python
float against an int32 step count, so it cannot be on here.)
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
