"""Algorithm families; importing the package registers every algorithm (see registry.py)."""

from . import (  # noqa: F401
    bruck,
    chain,
    dissemination,
    hierarchical,
    linear,
    pairwise,
    rabenseifner,
    recursive_doubling,
    ring,
    scatter_allgather,
    shm_direct,
    single_copy,
    tree,
)
