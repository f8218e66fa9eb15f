"""Reductions: the ops users name, the dtypes tensorwire carries, the kernels that combine them.

`reduce_op` (ReduceOp, Reduction, what users may pass as an op), `dtypes` (the registry of
carried dtypes and their wire codes), `validation` (which op/dtype pairs mean something),
`kernels` (the in-place reduction kernels), `torch_kernels` (torch's faster CPU loops for
16-bit floats), `carriers` (torch dtypes numpy cannot compute), `finalize` (AVG and
PREMUL_SUM after the last step) and `reference` (the single-process result tests compare with).
"""

from .reduce_op import ReduceOp, Reduction, premul_sum

__all__ = ["ReduceOp", "Reduction", "premul_sum"]
