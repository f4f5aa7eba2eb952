"""Ports two components must agree on, so the operator and the learner import one definition.

On a multislice TPU job, slice 0's first host runs both coordinators: JAX's own (the
coordination service ``jax.distributed.initialize`` binds) and libtpu's Megascale coordinator
(``MEGASCALE_COORDINATOR_ADDRESS``, cross-slice DCN set-up). They need different ports; 8081 is
the Megascale port Ray and levanter use.
"""

JAX_COORDINATOR_PORT = 8482
MEGASCALE_COORDINATOR_PORT = 8081
