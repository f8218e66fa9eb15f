"""DDP communication hooks that average gradients with tensorwire's compressed all_reduce:

    ddp.register_comm_hook(None, tensorwire.torch.bf16_allreduce_hook)   # or a tensorwire group

Unlike torch's `bf16_compress_hook`, which casts the whole bucket and sums it in bfloat16, only
the pieces that cross between hosts travel in 16 bits; within a host and in every sum the
gradients keep their precision, and every rank gets the same values (docs/torch.md). Their
annotations are objects, not strings (no `from __future__ import annotations`): DDP compares
them with torch's types; and their names are not torch's (DDP demands NCCL of a hook named
`bf16_compress_hook`).
"""

from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError
from ..ops import ReduceOp
from .process_group import ProcessGroupTensorwire
from .work import TensorwireWork


def _average(state: Any, bucket: dist.GradBucket, compress: str) -> torch.futures.Future[torch.Tensor]:
    pg = state if state is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupTensorwire):
        raise InvalidArgumentError(f"tensorwire's {compress} compress hook needs a tensorwire process group "
                                   f"(the state passed to register_comm_hook, or the default group); got "
                                   f"{type(pg).__name__}")
    grads = bucket.buffer()
    part = pg.tensorwire_group.all_reduce(grads, ReduceOp.AVG, async_op=True, compress=compress)
    return TensorwireWork([part], [grads], "all_reduce").get_future().then(lambda fut: fut.value()[0])


def bf16_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's float32/float64 gradients over the group, crossing between hosts in
    bfloat16 (`compress="bf16"`). `state`: the tensorwire process group, or None for the
    default one."""
    return _average(state, bucket, "bf16")


def fp16_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """As bf16_allreduce_hook, in float16: 3 more bits of precision, each piece scaled to fit
    float16's range."""
    return _average(state, bucket, "fp16")
