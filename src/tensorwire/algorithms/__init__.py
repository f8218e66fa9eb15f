"""Algorithm families; importing the package registers every algorithm (see registry.py)."""

from . import dissemination, linear, pairwise, recursive_doubling, ring, shm_direct, tree  # noqa: F401
