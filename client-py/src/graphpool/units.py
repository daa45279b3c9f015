"""Byte sizes as people write them: ``"8GiB"``, ``"512MiB"``, ``"1.5G"``, ``4096``.

The same rules as the daemon's configuration (``src/units.rs``): binary units ``KiB``,
``MiB``, ``GiB``, ``TiB`` (also ``K``, ``M``, ``G``, ``T``), decimal units ``KB``, ``MB``,
``GB``, ``TB``, case-insensitive, fractions allowed with a unit (a plain byte count is whole).
"""

from __future__ import annotations

import math
import re

__all__ = ["format_size", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 1_000,
    "mb": 1_000_000,
    "gb": 1_000_000_000,
    "tb": 1_000_000_000_000,
}
_U64_MAX = (1 << 64) - 1
_SPLIT = re.compile(r"^([0-9.]*)(.*)$")


def parse_size(value: int | str) -> int:
    """Returns ``value`` in bytes.

    An ``int`` is taken as a byte count (it must be ≥ 0). A string is a number with an optional
    unit, e.g. ``"8GiB"``, ``"512 MiB"``, ``"1.5g"``, ``"2GB"``, ``"4096"``.

    Raises:
        ValueError: the value is negative, too large for 64 bits, or not a size.
    """
    if isinstance(value, bool):
        raise TypeError("a size must be an int or a str, not bool")
    if isinstance(value, int):
        if value < 0 or value > _U64_MAX:
            raise ValueError(f"invalid size {value}: must be between 0 and 2**64-1 bytes")
        return value
    if not isinstance(value, str):
        raise TypeError(f"a size must be an int or a str, not {type(value).__name__}")
    hint = "(write e.g. 8GiB, 512MiB, 1.5GB or a plain byte count)"
    s = value.strip()
    if not s:
        raise ValueError(f"invalid size {value!r}: empty {hint}")
    m = _SPLIT.match(s)
    assert m is not None  # the pattern matches every string
    num, unit = m.group(1), m.group(2).strip().lower()
    if unit not in _UNITS:
        raise ValueError(f"invalid size {value!r}: unknown unit {unit!r} {hint}")
    if not num:
        raise ValueError(f"invalid size {value!r}: no number {hint}")
    mult = _UNITS[unit]
    if num.isdigit():
        n = int(num) * mult
    elif mult == 1:
        raise ValueError(f"invalid size {value!r}: a byte count is a whole number {hint}")
    else:
        try:
            f = float(num)
        except ValueError:
            raise ValueError(f"invalid size {value!r}: not a number {hint}") from None
        v = f * mult
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"invalid size {value!r}: too large {hint}")
        n = round(v)
    if n > _U64_MAX:
        raise ValueError(f"invalid size {value!r}: too large {hint}")
    return n


def format_size(n: int) -> str:
    """Formats a byte count with a binary unit: ``"0 B"``, ``"2 MiB"``, ``"1.50 GiB"``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    v = float(n)
    i = 0
    while v >= 1024.0 and i + 1 < len(units):
        v /= 1024.0
        i += 1
    if i == 0:
        return f"{n} B"
    if abs(v - round(v)) < 0.005:
        return f"{v:.0f} {units[i]}"
    return f"{v:.2f} {units[i]}"
