"""Scheduling policies: plain Python, no JAX, no threads, no wall clock.

The live engine and the simulator drive the same policy objects; see
:mod:`jaxserve.sched.base` for the contract between them.
"""
