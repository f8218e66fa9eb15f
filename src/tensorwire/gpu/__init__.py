"""CUDA buffers in every collective and point-to-point call.

A collective on device buffers (torch CUDA tensors, or anything with
`__cuda_array_interface__` or a CUDA DLPack device, CuPy arrays among them) moves them
device to device between ranks of one host (CUDA IPC: each rank reads its peers' buffers,
reductions run as torch kernels on the GPU) and stages them through pinned host memory
everywhere else. See docs/gpu.md.

Only `is_device_buffer` is imported with tensorwire (and a hook for the transport, which
copies a CUDA buffer a peer sent into a host receive); the rest, and torch, load with the
first device buffer a call sees, so machines without CUDA, torch or CuPy pay nothing.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..transport import requests

_CUDA_DLPACK = (2, 13)  # kDLCUDA, kDLCUDAManaged


def is_device_buffer(obj: Any) -> bool:
    """Does `obj` live in CUDA device memory? Cheap, and imports nothing."""
    if type(obj) is np.ndarray:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) in _CUDA_DLPACK
    except Exception:  # a broken producer is as_array's to report
        return False


def _device_to_host(body: bytes, peer: int, out: np.ndarray) -> None:
    from .p2p import read_to_host

    read_to_host(body, peer, out)


requests.device_to_host = _device_to_host  # a CUDA buffer sent to a host receive (gpu/p2p.py)
