"""Reduction ops, op/dtype validation and the in-place reduction kernels.

Every reduction a collective performs goes through `reduce_into` (one numpy ufunc with
`out=`, looked up in a precomputed table), so the data path never loops per element in
Python and never allocates. `reference` computes the same result on one process for tests.

Dtypes are known by a small registry: numpy's numeric types and bool, plus the ml_dtypes
floats (bfloat16, float8_*) which are registered the first time one is seen, so neither
ml_dtypes nor torch is imported when tensorwire is. torch tensors of dtypes numpy cannot
compute (bfloat16 and float8_* without ml_dtypes, complex32) travel as *carriers* (`carrier`):
numpy moves them as bytes and torch's own kernels reduce them, so torch alone is enough.

Two speed notes, measured on the reference machine (x86-64, numpy 2.4): numpy's float16
loops run at ~0.25 GB/s and ml_dtypes' bfloat16 loops at ~1 GB/s, against ~11 GB/s for
float32. When torch is *already imported* by the application, float16/bfloat16 reductions
of at least `TORCH_KERNEL_MIN_ELEMENTS` elements run through torch's vectorised CPU kernels
on the same memory instead (30-60x faster for float16, ~8x for bfloat16); the results are
bit-identical except for the sign of equal zeros in MIN/MAX and NaN payloads.
"""

from __future__ import annotations

import enum
import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

__all__ = [
    "ReduceOp",
    "Reduction",
    "premul_sum",
    "as_reduction",
    "check_dtype",
    "check_op_dtype",
    "op_undefined",
    "is_supported_dtype",
    "dtype_category",
    "reduce_into",
    "finalize",
    "reference",
    "dtype_code",
    "dtype_from_code",
    "dtype_name",
    "dtype_from_name",
    "TORCH_KERNEL_MIN_ELEMENTS",
    "SUPPORTED_NUMS",
    "carrier",
]


class ReduceOp(enum.IntEnum):
    """The reductions, numbered as torch.distributed's RedOpType so values can cross the API."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


@dataclass(frozen=True)
class Reduction:
    """An op plus its parameter: only PREMUL_SUM carries one (the factor applied to the sum).

    PREMUL_SUM is applied as `factor * sum(x_i)` after the reduction, which equals NCCL's
    `sum(factor * x_i)` only when every rank passes the same factor; the collective layer
    must therefore put the factor into the fingerprint it compares across ranks.
    """

    op: ReduceOp
    factor: float | None = None

    def __post_init__(self) -> None:
        try:
            op = ReduceOp(self.op)
        except ValueError:
            raise InvalidArgumentError(f"Reduction: unknown op {self.op!r}") from None
        object.__setattr__(self, "op", op)
        if op is ReduceOp.PREMUL_SUM:
            if self.factor is None:
                raise InvalidArgumentError(
                    "Reduction: PREMUL_SUM needs a factor (use tensorwire.ops.premul_sum(factor))"
                )
            object.__setattr__(self, "factor", _as_factor(self.factor))
        elif self.factor is not None:
            raise InvalidArgumentError(f"Reduction: {op.name} takes no factor (got {self.factor!r})")

    def __str__(self) -> str:
        return self.op.name if self.factor is None else f"{self.op.name}({self.factor!r})"


def _as_factor(factor: Any) -> float:
    """A real scalar (python/numpy number or a one-element tensor) as a python float."""
    if not isinstance(factor, (str, bytes, bool, np.bool_, complex, np.complexfloating)):
        try:
            return float(factor)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise InvalidArgumentError(
        f"Reduction: PREMUL_SUM factor must be a real number or a one-element tensor, "
        f"got {type(factor).__name__} {factor!r}"
    )


def premul_sum(factor: float) -> Reduction:
    """PREMUL_SUM with `factor` (torch's `_make_nccl_premul_sum`; e.g. 1/world_size for DDP)."""
    return Reduction(ReduceOp.PREMUL_SUM, factor)


_NAMES: dict[str, ReduceOp] = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "prod": ReduceOp.PRODUCT,
    "product": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "band": ReduceOp.BAND,
    "bor": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR,
    "premul_sum": ReduceOp.PREMUL_SUM,
}
_PLAIN = {op: Reduction(op) for op in ReduceOp if op is not ReduceOp.PREMUL_SUM}


def _where(rank: int | None, collective: str | None) -> str:
    parts = []
    if rank is not None:
        parts.append(f"rank {rank}")
    if collective:
        parts.append(collective)
    return ", ".join(parts) + ": " if parts else ""


def as_reduction(op: Any, *, rank: int | None = None, collective: str | None = None) -> Reduction:
    """Normalise what users pass as `op` (ours, a string, or torch's ReduceOp) to a Reduction.

    torch is never imported: its RedOpType values are recognised by `.name`, and a
    `torch.distributed.ReduceOp` object by its `.op` (and `.factor` for PREMUL_SUM).
    """
    if isinstance(op, Reduction):
        return op
    if isinstance(op, ReduceOp):
        if op is ReduceOp.PREMUL_SUM:
            raise InvalidArgumentError(
                f"{_where(rank, collective)}PREMUL_SUM needs a factor: pass "
                "tensorwire.ops.premul_sum(factor) (or torch.distributed._make_nccl_premul_sum(factor))"
            )
        return _PLAIN[op]
    if isinstance(op, str):
        found = _NAMES.get(op.strip().lower())
        if found is None:
            raise InvalidArgumentError(
                f"{_where(rank, collective)}unknown reduce op {op!r} "
                f"(expected one of {', '.join(n for n in _NAMES if n != 'premul_sum')})"
            )
        return as_reduction(found, rank=rank, collective=collective)
    if isinstance(op, (int, np.integer)) and not isinstance(op, (bool, np.bool_)):
        try:
            return as_reduction(ReduceOp(int(op)), rank=rank, collective=collective)
        except ValueError:
            raise InvalidArgumentError(f"{_where(rank, collective)}unknown reduce op number {op!r}") from None
    module = type(op).__module__ or ""
    if module.startswith("torch") or isinstance(op, enum.Enum):
        inner = getattr(op, "op", None)  # a torch.distributed.ReduceOp object wraps a RedOpType
        name = _enum_name(inner if inner is not None else op)
        red_op = ReduceOp.__members__.get(name or "")
        if red_op is ReduceOp.PREMUL_SUM:
            try:
                factor = op.factor
            except (AttributeError, RuntimeError):
                raise InvalidArgumentError(
                    f"{_where(rank, collective)}torch PREMUL_SUM without a readable factor; "
                    "build it with torch.distributed._make_nccl_premul_sum(factor)"
                ) from None
            try:
                return Reduction(ReduceOp.PREMUL_SUM, _as_factor(factor))
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{_where(rank, collective)}{exc}") from None
        if red_op is not None:
            return _PLAIN[red_op]
    raise InvalidArgumentError(
        f"{_where(rank, collective)}cannot use {type(op).__module__}.{type(op).__qualname__} {op!r} "
        "as a reduce op (pass tensorwire.ReduceOp, a name like 'sum', or torch.distributed.ReduceOp)"
    )


def _enum_name(value: Any) -> str | None:
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    text = str(value)  # torch's RedOpType prints as 'RedOpType.SUM'
    return text.rsplit(".", 1)[-1] if "." in text else None


# --------------------------------------------------------------------------- dtype registry

@dataclass(frozen=True)
class _DType:
    code: int
    name: str  # nccl-tests style where one exists
    category: str  # 'b' bool, 'i' signed, 'u' unsigned, 'f' real float, 'c' complex
    dtype: np.dtype
    arithmetic: bool = True  # False: movable but the ufuncs are missing (an old ml_dtypes)
    low_precision: bool = False  # scalars are applied in float32 (exactly representable there)
    carried: _Carried | None = None  # a carrier's torch side: torch computes it (see `carrier`)


# Stable wire codes. Never renumber; append.
_NUMPY_CODES: list[tuple[int, str, str, Any]] = [
    (0, "bool", "b", np.bool_),
    (1, "int8", "i", np.int8),
    (2, "uint8", "u", np.uint8),
    (3, "int16", "i", np.int16),
    (4, "uint16", "u", np.uint16),
    (5, "int32", "i", np.int32),
    (6, "uint32", "u", np.uint32),
    (7, "int64", "i", np.int64),
    (8, "uint64", "u", np.uint64),
    (9, "half", "f", np.float16),
    (10, "float", "f", np.float32),
    (11, "double", "f", np.float64),
    (12, "longdouble", "f", np.longdouble),
    (13, "complex64", "c", np.complex64),
    (14, "complex128", "c", np.complex128),
    (15, "clongdouble", "c", np.clongdouble),
]
_ML_CODES: list[tuple[int, str, str]] = [  # (code, ml_dtypes attribute, name)
    (16, "bfloat16", "bfloat16"),
    (17, "float8_e4m3fn", "f8e4m3"),
    (18, "float8_e5m2", "f8e5m2"),
    (19, "float8_e4m3fnuz", "float8_e4m3fnuz"),
    (20, "float8_e5m2fnuz", "float8_e5m2fnuz"),
    (21, "float8_e8m0fnu", "float8_e8m0fnu"),
    (22, "float8_e4m3b11fnuz", "float8_e4m3b11fnuz"),
    (23, "float8_e3m4", "float8_e3m4"),
    (24, "float8_e4m3", "float8_e4m3"),
]
_ML_CODE_SET = frozenset(c for c, _, _ in _ML_CODES)

_BY_CODE: dict[int, _DType] = {}
_BY_NUM: dict[int, _DType] = {}  # dtype.num -> entry (several numpy chars can share an entry)
SUPPORTED_NUMS = _BY_NUM
"""`dtype.num in SUPPORTED_NUMS and dtype.isnative` is the cheapest support test (kept current)."""
_BY_NAME: dict[str, _DType] = {}
_ml_state = {"tried": False, "ok": False}
_registry_lock = threading.Lock()


def _register(entry: _DType, *nums: int) -> None:
    _BY_CODE[entry.code] = entry
    for num in nums:
        _BY_NUM[num] = entry
    _BY_NAME[entry.name] = entry
    _BY_NAME[entry.dtype.name] = entry


def _register_numpy() -> None:
    for code, name, category, scalar in _NUMPY_CODES:
        dt = np.dtype(scalar)
        _register(_DType(code, name, category, dt, low_precision=code == 9), dt.num)
    # Platform aliases ('q' vs 'l', 'i' vs 'l' on Windows, 'g' == 'd' on some ABIs) get the
    # entry of the canonical type with the same kind and size, so codes stay portable.
    canonical = {(e.dtype.kind, e.dtype.itemsize): e for e in _BY_CODE.values()}
    for char in "?bBhHiIlLqQefdgFDG":
        dt = np.dtype(char)
        if dt.num not in _BY_NUM:
            _BY_NUM[dt.num] = canonical[(dt.kind, dt.itemsize)]


def _ufuncs_work(dt: np.dtype) -> bool:
    """Whether this ml_dtypes version registers the arithmetic loops (checked, not assumed)."""
    try:
        a = np.ones(2, dt)
        for ufunc in (np.add, np.multiply, np.minimum, np.maximum, np.true_divide):
            ufunc(a, a, out=a)
        return True
    except Exception:
        return False


def _register_ml_dtypes() -> bool:
    """Register the ml_dtypes floats once; False when ml_dtypes is not installed."""
    if not _ml_state["tried"]:
        with _registry_lock:
            if not _ml_state["tried"]:
                _ml_state["ok"] = _load_ml_dtypes()
                _ml_state["tried"] = True
    return _ml_state["ok"]


def _load_ml_dtypes() -> bool:
    try:
        import ml_dtypes
    except ImportError:
        return False
    for code, attr, name in _ML_CODES:
        scalar = getattr(ml_dtypes, attr, None)
        if scalar is None:  # older ml_dtypes
            continue
        dt = np.dtype(scalar)
        entry = _DType(code, name, "f", dt, arithmetic=_ufuncs_work(dt), low_precision=True)
        _register(entry, dt.num)
        _BY_NAME[attr] = entry
        _fill_table(entry, dt.num)
    return True


_register_numpy()


def _lookup(dtype: np.dtype) -> _DType | None:
    entry = _BY_NUM.get(dtype.num)
    if entry is None and dtype.num == _VOID:
        return _CARRIERS.get(dtype)
    if entry is None and not _ml_state["tried"] and (dtype.type.__module__ or "").startswith("ml_dtypes"):
        _register_ml_dtypes()
        entry = _BY_NUM.get(dtype.num)
    if entry is None or not dtype.isnative:
        return None
    return entry


_SUPPORTED_TEXT = (
    "supported: bool, int8..int64, uint8..uint64, float16/32/64, longdouble, complex64/128, "
    "clongdouble, with ml_dtypes bfloat16 and float8_*, and torch tensors of every dtype torch computes"
)


def is_supported_dtype(dtype: Any) -> bool:
    """Cheap test used on the hot path of `buffers.as_array`."""
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    return _lookup(dt) is not None


def check_dtype(dtype: Any, *, rank: int | None = None, collective: str | None = None,
                name: str = "tensor") -> np.dtype:
    """Raise unless tensorwire can carry this dtype; returns it as an np.dtype."""
    try:
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    except TypeError:
        raise InvalidArgumentError(f"{_where(rank, collective)}{name} has unknown dtype {dtype!r}") from None
    if _lookup(dt) is not None:
        return dt
    if not dt.isnative and dt.num in _BY_NUM:
        why = "non-native byte order; convert with arr.astype(arr.dtype.newbyteorder('='))"
    elif dt.fields is not None or dt.kind == "V":
        why = "structured/void dtypes are not reducible; send the raw bytes with arr.view(np.uint8)"
    elif (dt.type.__module__ or "").startswith("ml_dtypes"):
        why = "this ml_dtypes type is not supported"
    else:
        why = _SUPPORTED_TEXT
    raise InvalidArgumentError(f"{_where(rank, collective)}{name} has unsupported dtype {dt} ({why})")


def dtype_category(dtype: Any) -> str:
    """'b', 'i', 'u', 'f' or 'c' (ml_dtypes floats are 'f' although numpy calls them 'V')."""
    return _entry_or_raise(dtype).category


def _entry_or_raise(dtype: Any) -> _DType:
    dt = check_dtype(dtype)
    entry = _lookup(dt)
    assert entry is not None
    return entry


def op_undefined(op: ReduceOp, category: str) -> str:
    """Why `op` has no meaning for dtypes of `category` ('b', 'i', 'u', 'f', 'c'); '' if it has."""
    if op in _BITWISE and category not in "biu":
        return "bitwise ops need integer or bool dtypes"
    if op in (ReduceOp.MIN, ReduceOp.MAX) and category == "c":
        return "complex numbers are not ordered"
    if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) and category == "b":
        return "use SUM for any, PRODUCT for all, or cast first"
    return ""


def check_op_dtype(red: Reduction, dtype: Any, *, rank: int, collective: str) -> None:
    """Reject (op, dtype) pairs that have no meaning, before anything is sent."""
    if isinstance(dtype, np.dtype) and dtype.isnative and dtype.num in _TABLE[red.op]:
        return  # the kernel table holds exactly the valid pairs
    dt = check_dtype(dtype, rank=rank, collective=collective)
    entry = _lookup(dt)
    assert entry is not None
    where = _where(rank, collective)
    why = op_undefined(red.op, entry.category)
    if why:
        label = dt.name if entry.carried is None else str(entry.carried.tdtype)
        raise InvalidArgumentError(f"{where}{red.op.name} is not defined for {label} ({why})")
    if not entry.arithmetic:
        raise InvalidArgumentError(
            f"{where}{red.op.name} is not available for {dt.name}: the installed ml_dtypes has no ufunc "
            "loops for it (upgrade ml_dtypes, or reduce in a wider dtype)"
        )


# --------------------------------------------------------------------------- kernels

_KIND_UFUNCS: dict[str, dict[ReduceOp, np.ufunc]] = {
    "b": {
        ReduceOp.SUM: np.logical_or,
        ReduceOp.PRODUCT: np.logical_and,
        ReduceOp.MIN: np.logical_and,
        ReduceOp.MAX: np.logical_or,
        ReduceOp.BAND: np.logical_and,
        ReduceOp.BOR: np.logical_or,
        ReduceOp.BXOR: np.logical_xor,
    },
    "i": {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PREMUL_SUM: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    },
}
_KIND_UFUNCS["u"] = _KIND_UFUNCS["i"]
_KIND_UFUNCS["f"] = {op: u for op, u in _KIND_UFUNCS["i"].items() if op not in _BITWISE}
_KIND_UFUNCS["c"] = {op: u for op, u in _KIND_UFUNCS["f"].items() if op not in (ReduceOp.MIN, ReduceOp.MAX)}

TORCH_KERNEL_MIN_ELEMENTS = 1 << 14
"""Below this many elements the numpy ufunc is used even when torch could be (call overhead ~6 µs)."""

# _TABLE[op][dtype.num] -> kernel(dst, src, dst); ml_dtypes entries join when registered.
# The output is passed positionally: a ufunc parses `out=` about 0.3 µs slower.
_TABLE: list[dict[int, Any]] = [{} for _ in ReduceOp]
_TORCH_CODES = frozenset({9, 16})  # float16, bfloat16: torch's CPU kernels are much faster


def _fill_table(entry: _DType, num: int) -> None:
    if entry.arithmetic:
        for op, ufunc in _KIND_UFUNCS[entry.category].items():
            kernel = _three_argument(ufunc)
            _TABLE[op][num] = _torch_capable(kernel, op) if entry.code in _TORCH_CODES else kernel


def _three_argument(ufunc: np.ufunc) -> Callable[..., None]:
    """kernel(a, b, out): the ufunc itself where a positional output is allowed. numpy 2.4
    deprecates a third positional argument to minimum and maximum (they may become n-ary), so
    those two name their output."""
    if ufunc not in (np.minimum, np.maximum):
        return ufunc

    def kernel(dst: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
        ufunc(dst, src, out=out)

    kernel.__name__ = ufunc.__name__
    return kernel


_IN_PLACE_ONLY: set[Callable[..., None]] = set()
"""Kernels whose torch path reduces into their first argument, ignoring `out` (see apply_to)."""


def _torch_capable(kernel: Callable[..., None], op: ReduceOp) -> Callable[..., None]:
    """The numpy kernel, but large buffers go through torch when the application has imported it."""

    def either(dst: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
        if dst.size < TORCH_KERNEL_MIN_ELEMENTS or not _torch_reduce(dst, src, op):
            kernel(dst, src, out)

    either.__name__ = f"{kernel.__name__}_or_torch"
    _IN_PLACE_ONLY.add(either)
    return either


for _num, _entry in _BY_NUM.items():
    _fill_table(_entry, _num)
del _num, _entry


def _resolve(op: ReduceOp, dtype: np.dtype) -> Any:
    """Slow path of `reduce_into`: first sight of an ml_dtypes type, or an invalid pair."""
    entry = _lookup(dtype)
    if entry is None:
        check_dtype(dtype, collective="reduce_into")  # raises with the reason
        raise AssertionError("unreachable")
    ufunc = _TABLE[op].get(dtype.num) if entry.carried is None else _CARRIER_KERNELS.get((op, entry.code))
    if ufunc is None:
        raise InvalidArgumentError(f"reduce_into: {op.name} is not defined for {entry.name}")
    return ufunc


# dtype.num -> (numpy view dtype accepted by torch.from_numpy, torch dtype); None until built.
_torch_kinds: dict[int, tuple[np.dtype, Any]] | None = None
_torch_state = {"failed": False}


def _torch_table(torch: Any) -> dict[int, tuple[np.dtype, Any]] | None:
    """float16/bfloat16 views for torch; built once, the first time torch is found loaded."""
    global _torch_kinds
    if _torch_kinds is not None or _torch_state["failed"]:
        return _torch_kinds
    try:
        table = {np.dtype(np.float16).num: (np.dtype(np.float16), torch.float16)}
        if _register_ml_dtypes():
            bf16 = _BY_CODE.get(16)
            if bf16 is not None:
                table[bf16.dtype.num] = (np.dtype(np.int16), torch.bfloat16)
        _spend_read_only_warning(torch)
        _torch_kinds = table
    except Exception:  # a half-initialised or unusual torch: keep the numpy path
        _torch_state["failed"] = True
    return _torch_kinds


def _as_torch(torch: Any, arr: np.ndarray, view_dtype: np.dtype, tdtype: Any) -> Any:
    t = torch.from_numpy(arr.view(view_dtype))
    return t if t.dtype == tdtype else t.view(tdtype)


def _torch_reduce(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    table = _torch_table(torch)
    if table is None:
        return False
    kinds = table.get(dst.dtype.num)
    if (kinds is None or src.dtype != dst.dtype or src.shape != dst.shape or not dst.dtype.isnative
            or not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.aligned
                    and src.flags.aligned and dst.flags.writeable)):
        return False
    d = _as_torch(torch, dst, *kinds)
    s = _as_torch(torch, src, *kinds)
    if op == ReduceOp.PRODUCT:
        d.mul_(s)
    elif op == ReduceOp.MIN:
        torch.minimum(d, s, out=d)
    elif op == ReduceOp.MAX:
        torch.maximum(d, s, out=d)
    else:
        d.add_(s)
    return True


# --------------------------------------------------------------------------- carriers

_VOID = np.dtype(np.void).num
_CARRIED: dict[str, tuple[int, str, str, str | None]] = {
    # torch dtype: (wire code, name, category, the torch dtype its arithmetic runs in where torch
    # has no CPU kernels for the dtype itself; torch 2.13 adds float8 only through float32)
    "bfloat16": (16, "bfloat16", "f", None),
    "float8_e4m3fn": (17, "f8e4m3", "f", "float32"),
    "float8_e5m2": (18, "f8e5m2", "f", "float32"),
    "float8_e4m3fnuz": (19, "float8_e4m3fnuz", "f", "float32"),
    "float8_e5m2fnuz": (20, "float8_e5m2fnuz", "f", "float32"),
    "float8_e8m0fnu": (21, "float8_e8m0fnu", "f", "float32"),
    "complex32": (25, "complex32", "c", "complex64"),
}
"""The torch dtypes that have carriers; codes 16-21 are ml_dtypes' (the same bytes on the wire,
so a rank with ml_dtypes and one without agree)."""
_CARRIERS: dict[np.dtype, _DType] = {}
_CARRIER_KERNELS: dict[tuple[ReduceOp, int], Callable[..., None]] = {}


class _Carried:
    """A carrier's torch side: its torch dtype, and the wider one torch computes it in where
    torch has no CPU kernels for it (None: its own). Every carrier array is a torch tensor's
    memory, so torch is loaded whenever one exists."""

    __slots__ = ("tdtype", "compute")

    def __init__(self, torch_name: str, compute: str | None) -> None:
        import torch

        self.tdtype = getattr(torch, torch_name)
        self.compute = None if compute is None else getattr(torch, compute)

    def tensor(self, arr: np.ndarray) -> Any:
        """arr's memory as a tensor, no copy: flat through torch.frombuffer where arr is
        contiguous (the cheapest way in), else with arr's shape and strides."""
        torch = sys.modules["torch"]
        if arr.flags.c_contiguous:
            return torch.frombuffer(arr, dtype=self.tdtype)
        return torch.from_numpy(arr.view(_SAME_SIZE_INT[arr.itemsize])).view(self.tdtype)

    def combine(self, fn: Any, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out = fn(a, b) elementwise (`out` may be `a` or `b`)."""
        if not out.size:
            return
        ta, tb, to = self.tensor(a), self.tensor(b), self.tensor(out)
        if self.compute is None:
            fn(ta, tb, out=to)
        else:
            to.copy_(fn(ta.to(self.compute), tb.to(self.compute)))

    def scale(self, buf: np.ndarray, divide_by: int | None, multiply_by: float | None) -> None:
        """buf /= divide_by or buf *= multiply_by, in place, the scalar applied in float32 at
        least (torch's own rule for its 16-bit floats, and what finalize does for the rest)."""
        if not buf.size:
            return
        t = self.tensor(buf)
        wide = t if self.compute is None else t.to(self.compute)
        if divide_by is not None:
            wide.div_(divide_by)
        else:
            wide.mul_(multiply_by)
        if wide is not t:
            t.copy_(wide)


_SAME_SIZE_INT = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32)}


def carrier(torch_name: str) -> np.dtype | None:
    """The numpy dtype that carries torch tensors of `torch_name` ('bfloat16', 'float8_e4m3fn',
    'complex32', ...) where numpy has none: a structured dtype of one unsigned integer field
    of the same size, named after the torch dtype. numpy copies, slices and sends it as any
    other dtype but has no arithmetic for it: every reduction and finalisation of a carrier
    runs through torch on the same memory (`_Carried`). None: no carrier for that dtype."""
    spec = _CARRIED.get(torch_name)
    if spec is None:
        return None
    code, name, category, compute = spec
    for dt, entry in _CARRIERS.items():
        if entry.code == code:
            return dt
    with _registry_lock:
        carried = _Carried(torch_name, compute)
        itemsize = carried.tdtype.itemsize
        dt = np.dtype([(f"torch.{torch_name}", f"=u{itemsize}")])
        entry = _DType(code, name, category, dt, low_precision=True, carried=carried)
        for op, ufunc in _KIND_UFUNCS[category].items():  # torch's function of numpy's name
            fn = getattr(sys.modules["torch"], ufunc.__name__)
            _CARRIER_KERNELS[(op, code)] = functools.partial(carried.combine, fn)
        _spend_read_only_warning(sys.modules["torch"])
        _CARRIERS[dt] = entry
    return dt


def _spend_read_only_warning(torch: Any) -> None:
    """torch warns once per process about wrapping read-only memory (received data is, and is
    only ever read by torch here); spend that warning now, silently."""
    probe = np.zeros(1, np.int16)
    probe.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.from_numpy(probe)
        torch.frombuffer(probe, dtype=torch.int16)


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
    """`dst = dst (op) src` in place; same shape and dtype (the caller guarantees it).

    One table lookup and one ufunc call; AVG and PREMUL_SUM accumulate as SUM here and are
    completed by `finalize` once, after the last step.
    """
    reduction_kernel(op, dst.dtype)(dst, src, dst)


def reduce_to(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
    """`out = a (op) b` without first copying `a` into `out` (out-of-place collectives)."""
    apply_to(reduction_kernel(op, out.dtype), out, a, b)


def writes_where_told(kernel: Any) -> bool:
    """Whether kernel(a, b, out) leaves `a` alone and writes `out`, which may be `b`: not a
    kernel whose torch path reduces into its first argument (_IN_PLACE_ONLY)."""
    return kernel not in _IN_PLACE_ONLY


def apply_to(kernel: Any, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """reduce_to with the kernel looked up already (callers that reduce many times)."""
    if not writes_where_told(kernel):  # its torch path reduces in place: start from a copy
        np.copyto(out, a)
        a = out
    kernel(a, b, out)


def reduction_kernel(op: ReduceOp, dtype: np.dtype) -> Any:
    """The kernel `reduce_into` applies, called as kernel(a, b, dst); it takes three distinct
    arrays unless it is in _IN_PLACE_ONLY (a torch path for float16/bfloat16)."""
    try:
        return _TABLE[op][dtype.num]
    except KeyError:
        return _resolve(ReduceOp(op), dtype)


def _torch_scale(buf: np.ndarray, divide_by: int | None, multiply_by: float | None) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or buf.size < TORCH_KERNEL_MIN_ELEMENTS:
        return False
    table = _torch_table(torch)
    kinds = None if table is None else table.get(buf.dtype.num)
    if kinds is None or not (buf.flags.c_contiguous and buf.flags.aligned and buf.flags.writeable):
        return False
    t = _as_torch(torch, buf, *kinds)
    if divide_by is not None:
        t.div_(divide_by)
    else:
        t.mul_(multiply_by)
    return True


def finalize(buf: np.ndarray, red: Reduction, group_size: int) -> None:
    """Complete AVG (divide by the group size) and PREMUL_SUM (multiply by the factor) in place.

    Floats: AVG is a true division; float16/bfloat16/float8 apply the scalar in float32 so
    group sizes and factors that the narrow type cannot represent stay exact (carriers
    through torch, complex32 in complex64). Integers: AVG
    is floor division (-7 // 2 == -4); PREMUL_SUM with an integral factor that fits the
    dtype is an exact (wrapping) integer multiply, otherwise the product is computed in
    float64 and truncated toward zero when cast back (values beyond 2**53 lose precision,
    results outside the dtype's range are undefined).
    """
    op = red.op
    if op is not ReduceOp.AVG and op is not ReduceOp.PREMUL_SUM:
        return
    if group_size < 1:
        raise InvalidArgumentError(f"finalize: group_size must be >= 1, got {group_size}")
    entry = _lookup(buf.dtype)
    if entry is None or entry.category == "b" or not entry.arithmetic:
        raise InvalidArgumentError(f"finalize: {op.name} is not defined for {buf.dtype}")
    cat = entry.category
    if op is ReduceOp.AVG:
        if group_size == 1:
            return
        if entry.carried is not None:
            entry.carried.scale(buf, group_size, None)
            return
        if cat in "iu":
            info = np.iinfo(buf.dtype)
            divisor = buf.dtype.type(group_size) if group_size <= info.max else (
                np.int64(group_size) if cat == "i" else np.uint64(group_size))
            np.floor_divide(buf, divisor, out=buf, casting="unsafe")
        elif entry.low_precision:
            if not _torch_scale(buf, group_size, None):
                np.true_divide(buf, np.float32(group_size), out=buf, casting="unsafe")
        else:
            np.true_divide(buf, group_size, out=buf)
        return
    factor = red.factor
    assert factor is not None
    if entry.carried is not None:
        entry.carried.scale(buf, None, factor)
    elif cat in "iu":
        info = np.iinfo(buf.dtype)
        if math.isfinite(factor) and factor.is_integer() and info.min <= factor <= info.max:
            np.multiply(buf, buf.dtype.type(int(factor)), out=buf)
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                np.multiply(buf, factor, out=buf, casting="unsafe")
    elif entry.low_precision:
        if not _torch_scale(buf, None, factor):
            np.multiply(buf, np.float32(factor), out=buf, casting="unsafe")
    else:
        np.multiply(buf, factor, out=buf)


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


# --------------------------------------------------------------------------- codes and names

def dtype_code(dtype: Any) -> int:
    """Stable small integer for the dtype (goes into wire fingerprints)."""
    return _entry_or_raise(dtype).code


def dtype_from_code(code: int) -> np.dtype:
    """Inverse of `dtype_code`."""
    entry = _BY_CODE.get(code)
    if entry is None and code in _ML_CODE_SET and _register_ml_dtypes():
        entry = _BY_CODE.get(code)
    if entry is None:
        entry = next((c for c in _CARRIERS.values() if c.code == code), None)
    if entry is None:
        hint = " (needs ml_dtypes, or a newer one)" if code in _ML_CODE_SET else ""
        raise InvalidArgumentError(f"unknown dtype code {code!r}{hint}")
    return entry.dtype


def dtype_name(dtype: Any) -> str:
    """nccl-tests style name: 'float', 'double', 'half', 'bfloat16', 'int32', 'f8e4m3', ..."""
    return _entry_or_raise(dtype).name


_ALIASES: dict[str, str] = {
    "float": "float",  # nccl-tests meaning (float32), NOT numpy's python-float float64
    "fp32": "float",
    "f32": "float",
    "fp64": "double",
    "f64": "double",
    "fp16": "half",
    "f16": "half",
    "bf16": "bfloat16",
    "fp8_e4m3": "f8e4m3",
    "fp8_e5m2": "f8e5m2",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
}


def dtype_from_name(name: str) -> np.dtype:
    """A dtype from an nccl-tests name ('float' is float32 here), a numpy or an ml_dtypes name."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"dtype name must be a string, got {type(name).__name__}")
    key = name.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    entry = _BY_NAME.get(key)
    if entry is None and _register_ml_dtypes():
        entry = _BY_NAME.get(key)
    if entry is not None:
        return entry.dtype
    try:
        dt = np.dtype(name.strip())
    except TypeError:
        raise InvalidArgumentError(f"unknown dtype name {name!r} ({_SUPPORTED_TEXT})") from None
    return check_dtype(dt, name=f"dtype name {name!r}")
