"""Scheduling policies: plain Python, no JAX, no threads, no wall clock.

The live engine and the simulator drive the same policy objects; see
:mod:`jaxserve.sched.base` for the contract between them.
"""

# Policies the server and the simulator can be started with (``--policy``).
TEXT_STREAM_POLICIES = ("arlo", "st", "dt", "infaas")  # Arlo and its baselines: one text stream owns every instance
IMAGE_POLICIES = ("otas", "pets", "tome", "vpt")  # OTAS and its baselines: one image model
# Tabi's cascade and its baselines, over the text encoders the cascade profile names (jaxserve/sched/tabi.py)
CASCADE_POLICIES = ("tabi", "tabi-small", "tabi-large", "tabi-infaas", "tabi-cocktail")
# AsyFunc and its baselines (jaxserve/sched/asyfunc.py): served live and simulated
ASYFUNC_POLICIES = ("asyfunc", "asyfunc-nolls", "asyfunc-batch")
# QUART and its baselines (jaxserve/sched/quart.py): one model as a pipeline of stages; quart is also served
# live (jaxserve/quart_exec.py), its baselines are simulated only
QUART_POLICIES = ("quart", "quart-infless", "quart-inferline", "quart-cocktail")
SERVE_POLICIES = ("default", *TEXT_STREAM_POLICIES, *IMAGE_POLICIES, *CASCADE_POLICIES, *ASYFUNC_POLICIES,
                  *QUART_POLICIES)
