"""The result every rank must hold, computed on one process: what tests compare against."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .finalize import finalize
from .kernels import reduce_into
from .reduce_op import Reduction
from .validation import check_op_dtype


def reference(arrays: Sequence[np.ndarray], red: Reduction) -> np.ndarray:
    """The result every rank must hold: fold left in rank order in the arrays' own dtype, then finalize.

    Tests of every later layer compare against this; inputs are not modified.
    """
    if len(arrays) == 0:
        raise InvalidArgumentError("reference: need at least one array")
    first = np.asarray(arrays[0])
    for i, a in enumerate(arrays[1:], start=1):
        if a.dtype != first.dtype or a.shape != first.shape:
            raise InvalidArgumentError(
                f"reference: array {i} is {a.dtype}{list(a.shape)}, "
                f"array 0 is {first.dtype}{list(first.shape)}"
            )
    check_op_dtype(red, first.dtype, rank=0, collective="reference")
    out = np.array(first, copy=True, order="C")
    for a in arrays[1:]:
        reduce_into(out, np.asarray(a, order="C"), red.op)
    finalize(out, red, len(arrays))
    return out
