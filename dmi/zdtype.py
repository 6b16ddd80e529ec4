"""bfloat16 for zarr-python 3.1 (which has none), per the zarr-extensions ``bfloat16`` spec.

Zarr v3 only: JSON name ``"bfloat16"``, no configuration; fill value is a JSON number, ``"NaN"``
(= ``"0x7fc0"``), ``"Infinity"``, ``"-Infinity"`` or ``"0x"`` + 4 hex digits of the bit pattern.
The NumPy dtype is ``ml_dtypes.bfloat16``. Built on zarr's public ``zarr.dtype`` API only (a
``Float16`` that wraps bfloat16), so it works across zarr 3 releases. zarr 3.1 collects the
``zarr.data_type`` entry point (pyproject.toml) but never loads it: ``register()`` does it by hand,
on import of this module, which ``import dmi`` arranges for as soon as zarr is imported.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, NoReturn

import ml_dtypes
import numpy as np
from zarr.dtype import DataTypeValidationError, Float16, data_type_registry

if TYPE_CHECKING:
    from typing import Self  # 3.11+, like zarr itself

    JSON = object
    ZarrFormat = Literal[2, 3]
    DTypeJSON = object

__all__ = ["BF16", "BFloat16", "register"]

BF16 = np.dtype(ml_dtypes.bfloat16)
_NAN_BITS = 0x7FC0  # the NaN that JSON "NaN" stands for (spec)
_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_BYTE_ORDER = {"little": "<", "big": ">", None: "|"}


def _float_to_json(x: float) -> float | str:
    """A float as a Zarr v3 JSON fill value: a number, or "NaN" / "Infinity" / "-Infinity"."""
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _parse_str(s: str | bytes) -> np.generic | None:
    """JSON float string ("NaN", "Infinity", "-Infinity", "0x7fc0") or decimal text; None if invalid."""
    s = s.decode("latin-1") if isinstance(s, bytes) else s
    if s in _SPECIAL:
        return BF16.type(_SPECIAL[s])
    if s[:2] in ("0x", "0X"):
        # the hex digits are the bf16 bit pattern (zarr's float_from_json_v3 would read them as float16)
        if re.fullmatch(r"0[xX][0-9a-fA-F]{4}", s) is None:
            return None
        return np.array(int(s, 16), dtype="<u2").view(BF16)[()]
    try:
        return BF16.type(float(s))
    except ValueError:
        return None


def _no_v2() -> NoReturn:
    raise DataTypeValidationError(
        "bfloat16 is a Zarr v3 extension data type; Zarr v2 has no bfloat16. "
        "Use zarr_format=3 (or store float32)."
    )


@dataclass(frozen=True, kw_only=True)
class BFloat16(Float16):
    """Zarr v3 ``bfloat16`` wrapping ``np.dtype(ml_dtypes.bfloat16)``; both byte orders work.
    (A subclass of zarr's public ``Float16``: the float behavior it inherits is the same.)"""

    # ml_dtypes dtypes are instances of their own dtype class, so the float base's
    # `type(dtype) is dtype_cls` check matches bfloat16 only (not V2 / float16).
    dtype_cls: ClassVar[type] = type(BF16)
    _zarr_v3_name: ClassVar[Literal["bfloat16"]] = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @property
    def item_size(self) -> int:
        return 2

    def to_native_dtype(self) -> np.dtype:
        # dtype_cls() cannot be instantiated for an ml_dtypes class; start from BF16. Its
        # newbyteorder(">") gives a working big-endian bf16 (ml_dtypes byte-swaps on casts).
        return BF16.newbyteorder(_BYTE_ORDER[self.endianness])

    @classmethod
    def _check_json_v3(cls, data: DTypeJSON) -> bool:
        # a v3 extension may also be written as {"name": ..., "configuration": {}}
        if isinstance(data, dict):
            return (data.get("name") == cls._zarr_v3_name and not data.get("configuration")
                    and set(data) <= {"name", "configuration"})
        return data == cls._zarr_v3_name

    # v2: refuse clearly (BaseFloat would write "<V2", which reads back as raw bytes).
    @classmethod
    def _check_json_v2(cls, data: DTypeJSON) -> bool:
        return False

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        _no_v2()

    def to_json(self, zarr_format: ZarrFormat) -> str:  # type: ignore[override]
        if zarr_format == 3:
            return self._zarr_v3_name
        _no_v2()

    # Strings: ml_dtypes 0.6 segfaults on bfloat16("abc"), so never hand it text; parse here.
    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, str | bytes):
            return _parse_str(data) is not None
        return super()._check_scalar(data)

    def _cast_scalar_unchecked(self, data: object) -> np.generic:
        if isinstance(data, str | bytes):
            return _parse_str(data)  # type: ignore[return-value]
        return BF16.type(data)

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> np.generic:  # type: ignore[override]
        if zarr_format != 3:
            _no_v2()
        if isinstance(data, int | float | str) and not isinstance(data, bool) and self._check_scalar(data):
            return self._cast_scalar_unchecked(data)
        raise TypeError(f"Invalid bfloat16 fill value {data!r}: expected a number, 'NaN', "
                        "'Infinity', '-Infinity' or '0x' + 4 hex digits")

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:  # type: ignore[override]
        if zarr_format != 3:
            _no_v2()
        x = self.cast_scalar(data)
        bits = int(np.array(x, dtype=BF16).view("<u2"))
        if math.isnan(float(x)) and bits != _NAN_BITS:
            return f"0x{bits:04x}"  # keep NaN payload / sign, which "NaN" would lose
        return _float_to_json(x)  # exact: every bf16 is a float64


def register() -> None:
    """Register BFloat16 in zarr's data type registry (idempotent)."""
    data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)


register()
