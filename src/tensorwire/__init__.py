"""tensorwire: collective communication for distributed AI and HPC.

    import tensorwire as tw
    tw.init()                      # reads tensorwire run / torchrun / mpirun / Slurm env
    tw.all_reduce(x)               # numpy arrays, torch CPU tensors, any buffer, in place
"""

from types import ModuleType as _ModuleType

from .api import (
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_gatherv,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    config,
    destroy,
    gather,
    gather_object,
    gatherv,
    get_rank,
    get_world_size,
    init,
    iprobe_any,
    irecv,
    irecv_any,
    is_initialized,
    isend,
    new_group,
    probe_any,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    reduce_scatterv,
    scatter,
    scatter_object_list,
    scatterv,
    send,
    sendrecv,
    shrink,
    split,
    topology,
    world,
)
from .errors import (
    AbortedError,
    AuthenticationError,
    CollectiveMismatchError,
    CudaDriverError,
    InvalidArgumentError,
    NotInitializedError,
    PeerLostError,
    RendezvousError,
    ResourceError,
    StoreLostError,
    TensorwireError,
    TensorwireWarning,
    TimeoutError,
    UnauthenticatedJobWarning,
)
from .group import Group
from .ops import ReduceOp, Reduction, premul_sum
from .work import Work

__version__ = "0.1.0"
__all__ = sorted(name for name, value in globals().items()  # the names above, not the submodules
                 if not name.startswith("_") and not isinstance(value, _ModuleType))
