"""The dtypes tensorwire carries: a registry of wire codes, names and categories.

numpy's numeric types and bool are registered at import; the ml_dtypes floats (bfloat16,
float8_*) the first time one is seen, so neither ml_dtypes nor torch is imported when
tensorwire is; torch dtypes numpy cannot compute join as carriers (`carriers`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError, call_prefix

if TYPE_CHECKING:
    from .carriers import Carried


@dataclass(frozen=True)
class DType:
    """One registered dtype: its wire code and names, and how its reductions are computed."""

    code: int
    name: str  # nccl-tests style where one exists
    category: str  # 'b' bool, 'i' signed, 'u' unsigned, 'f' real float, 'c' complex
    dtype: np.dtype
    arithmetic: bool = True  # False: movable but the ufuncs are missing (an old ml_dtypes)
    low_precision: bool = False  # scalars are applied in float32 (exactly representable there)
    carried: Carried | None = None  # a carrier's torch side: torch computes it (carriers.py)


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

_BY_CODE: dict[int, DType] = {}
_BY_NUM: dict[int, DType] = {}  # dtype.num -> entry (several numpy chars can share an entry)
SUPPORTED_NUMS = _BY_NUM
"""`dtype.num in SUPPORTED_NUMS and dtype.isnative` is the cheapest support test (kept current)."""
_BY_NAME: dict[str, DType] = {}
_ml_state = {"tried": False, "ok": False}
_registry_lock = threading.Lock()
_listeners: list[Callable[[DType, int], None]] = []
_VOID = np.dtype(np.void).num
_CARRIERS: dict[np.dtype, DType] = {}
"""The carriers (`carriers.carrier`) by their numpy dtype; all share numpy's void number."""


def _register(entry: DType, *nums: int) -> None:
    _BY_CODE[entry.code] = entry
    for num in nums:
        _BY_NUM[num] = entry
    _BY_NAME[entry.name] = entry
    _BY_NAME[entry.dtype.name] = entry


def _register_numpy() -> None:
    for code, name, category, scalar in _NUMPY_CODES:
        dt = np.dtype(scalar)
        _register(DType(code, name, category, dt, low_precision=code == 9), dt.num)
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


def load_ml_dtypes() -> bool:
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
        entry = DType(code, name, "f", dt, arithmetic=_ufuncs_work(dt), low_precision=True)
        _register(entry, dt.num)
        _BY_NAME[attr] = entry
        for listener in _listeners:
            listener(entry, dt.num)
    return True


_register_numpy()


def on_register(listener: Callable[[DType, int], None]) -> None:
    """Call listener(entry, dtype.num) for every dtype registered, now and later (not the
    carriers): the kernel table follows the registry without the registry knowing kernels."""
    with _registry_lock:
        _listeners.append(listener)
        for num, entry in _BY_NUM.items():
            listener(entry, num)


def add_carrier(entry: DType) -> None:
    """Register a carrier (`carriers.carrier` builds them, the first time each is asked for)."""
    _CARRIERS[entry.dtype] = entry


def carrier_by_code(code: int) -> DType | None:
    return next((c for c in _CARRIERS.values() if c.code == code), None)


def lookup(dtype: np.dtype) -> DType | None:
    """The registry's entry for `dtype` (ml_dtypes' registered on first sight); None: unsupported."""
    entry = _BY_NUM.get(dtype.num)
    if entry is None and dtype.num == _VOID:
        return _CARRIERS.get(dtype)
    if entry is None and not _ml_state["tried"] and (dtype.type.__module__ or "").startswith("ml_dtypes"):
        load_ml_dtypes()
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
    return lookup(dt) is not None


def check_dtype(dtype: Any, *, rank: int | None = None, collective: str | None = None,
                name: str = "tensor") -> np.dtype:
    """Raise unless tensorwire can carry this dtype; returns it as an np.dtype."""
    try:
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    except TypeError:
        raise InvalidArgumentError(
            f"{call_prefix(rank, collective)}{name} has unknown dtype {dtype!r}") from None
    if lookup(dt) is not None:
        return dt
    if not dt.isnative and dt.num in _BY_NUM:
        why = "non-native byte order; convert with arr.astype(arr.dtype.newbyteorder('='))"
    elif (dt.type.__module__ or "").startswith("ml_dtypes"):  # (numpy calls them void too)
        why = "this ml_dtypes type is not supported; move its bytes with arr.view(np.uint8)"
    elif dt.fields is not None or dt.kind == "V":
        why = "structured and void dtypes are not carried; send the raw bytes with arr.view(np.uint8)"
    else:
        why = _SUPPORTED_TEXT
    raise InvalidArgumentError(f"{call_prefix(rank, collective)}{name} has unsupported dtype {dt} ({why})")


def _entry_or_raise(dtype: Any) -> DType:
    dt = check_dtype(dtype)
    entry = lookup(dt)
    assert entry is not None
    return entry

def dtype_code(dtype: Any) -> int:
    """Stable small integer for the dtype (goes into wire fingerprints)."""
    return _entry_or_raise(dtype).code


def entry_for_code(code: int) -> DType | None:
    """numpy's or ml_dtypes' entry of a wire code (loading ml_dtypes for its codes), not a carrier's."""
    entry = _BY_CODE.get(code)
    if entry is None and code in _ML_CODE_SET and load_ml_dtypes():
        entry = _BY_CODE.get(code)
    return entry


def dtype_from_code(code: int) -> np.dtype:
    """Inverse of `dtype_code`."""
    entry = entry_for_code(code)
    if entry is None:
        entry = carrier_by_code(code)
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
    if entry is None and load_ml_dtypes():
        entry = _BY_NAME.get(key)
    if entry is not None:
        return entry.dtype
    try:
        dt = np.dtype(name.strip())
    except TypeError:
        raise InvalidArgumentError(f"unknown dtype name {name!r} ({_SUPPORTED_TEXT})") from None
    return check_dtype(dt, name=f"dtype name {name!r}")
