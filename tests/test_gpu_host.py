"""The parts of CUDA support that need no GPU, on every machine: the device reductions' semantics
against the host reference (torch's kernels are the same on CPU tensors), how device buffers
are recognised, the fingerprint of a device call, and a CUDA buffer where there is no CUDA
(a clear error on every rank, not a hang). tests/test_gpu.py runs the rest on a real GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorwire as tw
from tensorwire.gpu import is_device_buffer
from tensorwire.ops import ReduceOp, Reduction
from tensorwire.ops.reference import reference
from tensorwire.transport.wire import ON_DEVICE, Coll, Fingerprint, differences

torch = pytest.importorskip("torch")
from tensorwire.gpu import kernels  # noqa: E402 - needs torch

_DTYPES = {"float32": "f", "float64": "f", "float16": "f", "int8": "i", "int32": "i", "int64": "i",
           "uint8": "u", "uint32": "u", "bool": "b", "complex64": "c"}
_OPS = {"f": ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"],
        "c": ["SUM", "AVG", "PRODUCT", "PREMUL_SUM"],
        "i": ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"],
        "u": ["SUM", "PRODUCT", "BAND", "BOR", "BXOR"],  # the ops the GPU path folds on signed views
        "b": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]}
_CASES = [(d, op) for d, kind in _DTYPES.items() for op in _OPS[kind]]


def _inputs(dtype: str, n: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    kind = _DTYPES[dtype]
    if kind == "b":
        return [rng.random(count) < 0.5 for _ in range(n)]
    if kind in "iu":
        return [rng.integers(0 if kind == "u" else -40, 40, count).astype(dtype) for _ in range(n)]
    values = [rng.standard_normal(count) for _ in range(n)]
    if kind == "c":
        values = [v + 1j * rng.standard_normal(count) for v in values]
    return [v.astype(dtype) for v in values]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(_CASES), n=st.integers(1, 4), count=st.integers(0, 70),
       seed=st.integers(0, 2**31), in_place=st.integers(-1, 3), factor=st.sampled_from([0.5, 3.0, -2.0]))
def test_device_folds_match_the_host_reference(case, n, count, seed, in_place, factor) -> None:
    """kernels.fold + finalize on torch tensors give the host's result: bit for bit where the
    arithmetic is exact or done in one order (integers, bool, float32/64, complex sums), within
    rounding for float16 and complex products (torch and numpy multiply complex numbers with
    formulas that round apart by an ulp). `in_place`: the output is that input (folded first)."""
    dtype, name = case
    red = Reduction(ReduceOp.PREMUL_SUM, factor) if name == "PREMUL_SUM" else Reduction(ReduceOp[name])
    if _DTYPES[dtype] in "iu" and name == "PREMUL_SUM" and not float(factor).is_integer():
        red = Reduction(ReduceOp.PREMUL_SUM, 3.0)
    arrays = _inputs(dtype, n, count, seed)
    parts = [torch.from_numpy(a.copy()) for a in arrays]
    out = parts[in_place] if 0 <= in_place < n else torch.empty_like(parts[0])
    kernels.fold(out, parts, red.op)
    kernels.finalize(out, red, n)
    want = reference(arrays, red)
    got = out.numpy()
    reordered = 0 < in_place < n and name in ("SUM", "AVG", "PRODUCT", "PREMUL_SUM")
    complex_product = _DTYPES[dtype] == "c" and name == "PRODUCT"  # torch and numpy round it apart
    if _DTYPES[dtype] in "fc" and (reordered or dtype == "float16" or complex_product):
        # another order of the same additions: within what rounding allows of the inputs' sizes
        scale = sum(np.abs(a.astype(np.complex128)) for a in arrays) * max(1.0, abs(factor))
        if name == "PRODUCT":
            scale = np.prod([np.maximum(np.abs(a.astype(np.complex128)), 1.0) for a in arrays], axis=0)
        tol = 4 * n * np.finfo(np.float32 if dtype == "complex64" else dtype).eps * scale + 1e-30
        assert np.all(np.abs(got.astype(np.complex128) - want.astype(np.complex128)) <= tol), (got, want)
    else:
        np.testing.assert_array_equal(got, want)


def test_device_buffers_are_recognised_without_importing_anything() -> None:
    class Interface:  # what CuPy and numba arrays carry
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

    class DLPack:
        def __init__(self, kind: int) -> None:
            self.kind = kind

        def __dlpack_device__(self) -> tuple[int, int]:
            return (self.kind, 0)

    assert not is_device_buffer(np.ones(3))
    assert not is_device_buffer(torch.ones(3))
    assert not is_device_buffer(bytearray(4))
    assert is_device_buffer(Interface())
    assert is_device_buffer(DLPack(2)) and is_device_buffer(DLPack(13))  # kDLCUDA, kDLCUDAManaged
    assert not is_device_buffer(DLPack(1)) and not is_device_buffer(DLPack(3))  # CPU, pinned host


def test_a_device_call_never_matches_a_host_call() -> None:
    host = Fingerprint(Coll.ALL_REDUCE, 10, 0, -1, 8)
    device = host._replace(coll=Coll.ALL_REDUCE | ON_DEVICE)
    (why,) = differences(device, host)
    assert why.startswith("all_reduce of CUDA buffers vs all_reduce (every rank must pass buffers of the "
                          "same kind")
    (why,) = differences(device, host._replace(coll=Coll.BROADCAST | ON_DEVICE))
    assert why == "collective all_reduce of CUDA buffers vs broadcast of CUDA buffers"


def device_buffer_without_cuda() -> str:
    """On a machine without CUDA: a buffer that claims to be on a GPU."""
    class Interface:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

    group = tw.new_group()  # the error aborts this group, not the shared cluster's world
    try:
        group.all_reduce(Interface())
    except tw.TensorwireError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(60)
def test_a_cuda_buffer_without_cuda_is_an_error_on_every_rank(get_cluster) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/test_gpu.py covers it")
    for rank, text in enumerate(get_cluster(2).run(device_buffer_without_cuda)):
        assert "InvalidArgumentError" in text and "cannot be viewed as a CUDA tensor" in text, (rank, text)


@pytest.mark.parametrize("setting, error", [("1000", "TENSORWIRE_CUDA_SLOT=1000: expected a multiple of 256"),
                                            ("32K", None), ("0", None)])
def test_the_cuda_slot_keeps_every_dtype_aligned(monkeypatch: pytest.MonkeyPatch, setting: str,
                                                 error: str | None) -> None:
    from tensorwire.config import Config

    monkeypatch.setenv("TENSORWIRE_CUDA_SLOT", setting)
    if error is None:
        assert Config.from_env().cuda_slot % 256 == 0
    else:
        with pytest.raises(ValueError, match=error):
            Config.from_env()


def test_staged_pieces_follow_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """TENSORWIRE_CUDA_CHUNK=auto (the default): larger pieces where the staged host calls cross
    TCP than through shared memory; a size given is kept; one under 64K is an error."""
    from types import SimpleNamespace

    from tensorwire.config import Config
    from tensorwire.gpu import staged

    def group(one_host: bool, **env: str) -> SimpleNamespace:
        for name in ("TENSORWIRE_CUDA_CHUNK", "TENSORWIRE_TRANSPORT"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return SimpleNamespace(one_host=one_host, runtime=SimpleNamespace(config=Config.from_env()))

    assert staged.piece_bytes(group(True)) == staged.PIECE_BYTES < staged.PIECE_BYTES_TCP
    assert staged.piece_bytes(group(False)) == staged.PIECE_BYTES_TCP
    assert staged.piece_bytes(group(True, TENSORWIRE_TRANSPORT="tcp")) == staged.PIECE_BYTES_TCP
    assert staged.piece_bytes(group(False, TENSORWIRE_CUDA_CHUNK="1M")) == 1 << 20
    with pytest.raises(ValueError, match="TENSORWIRE_CUDA_CHUNK"):
        group(True, TENSORWIRE_CUDA_CHUNK="32K")


@pytest.mark.parametrize("gpus, visible, mps, staged", [(1, None, False, True), (2, None, False, False),
                                                         (1, "0", False, False), (1, None, True, False)])
def test_small_messages_are_staged_where_ranks_take_turns_on_one_gpu(
        monkeypatch: pytest.MonkeyPatch, gpus: int, visible: str | None, mps: bool, staged: bool) -> None:
    """gpu/p2p.staged_faster: up to TURNS_STAGED_BYTES, where the machine's only GPU serves
    every rank without MPS (CUDA_VISIBLE_DEVICES may give each rank a GPU of its own)."""
    from types import SimpleNamespace

    from tensorwire.gpu import device_flags, p2p

    fake = SimpleNamespace(cuda=SimpleNamespace(device_count=lambda: gpus))
    monkeypatch.setattr(p2p, "torch_module", lambda: fake)
    monkeypatch.setattr(device_flags, "mps_running", lambda: mps)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cached = (p2p._sharing_one_gpu, p2p._concurrent)  # each asked once a process: asked afresh here
    try:
        for f in cached:
            f.cache_clear()
        assert p2p.staged_faster(8) is staged
        assert p2p.staged_faster(p2p.TURNS_STAGED_BYTES) is staged
        assert not p2p.staged_faster(p2p.TURNS_STAGED_BYTES + 1)
    finally:
        for f in cached:
            f.cache_clear()
