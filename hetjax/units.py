"""Numbers for people: times, rates, sizes and shares in human units with sensible digits.

One helper per kind of quantity, used by every table hetjax prints (topology, plan, runners-up,
plots): `seconds` (µs / ms / s), `bits_per_s` (Mb/s, Gb/s, as links are quoted),
`bytes_per_s` (MB/s, GB/s, achieved bandwidth), `gib` (memory), `percent` (shares that may be
tiny, like the MFU of a toy model on a big topology), `count` ("1 layer", "3 layers").
"""

from __future__ import annotations

import math

MICRO = "\u00b5"  # µ
BYTES_PER_GBIT = 1e9 / 8  # bytes a second of a link quoted at 1 Gb/s (hardware, cost model)


def _sig(x: float, digits: int = 3) -> str:
    """`x` with `digits` significant digits, no exponent and no trailing zeros."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def seconds(t: float, digits: int = 3) -> str:
    """0.000049 -> '49 µs', 0.0412 -> '41.2 ms', 2.5 -> '2.5 s', 5400 -> '1.5 h'."""
    if not math.isfinite(t):
        return f"{t} s"
    a = abs(t)
    if a >= 3600:
        return f"{_sig(t / 3600, digits)} h"
    if a >= 60 * 10:
        return f"{_sig(t / 60, digits)} min"
    if a >= 1 or a == 0:
        return f"{_sig(t, digits)} s"
    if a >= 1e-3:
        return f"{_sig(t * 1e3, digits)} ms"
    if a >= 1e-6:
        return f"{_sig(t * 1e6, digits)} {MICRO}s"
    return f"{_sig(t * 1e9, digits)} ns"


def _scaled(x: float, unit: str, digits: int) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{_sig(x / factor, digits)} {prefix}{unit}"
    return f"{_sig(x, digits)} {unit}"


def bits_per_s(bits: float, digits: int = 3) -> str:
    """2e11 -> '200 Gb/s' (link rates, as NICs are quoted)."""
    return _scaled(bits, "b/s", digits)


def bytes_per_s(b: float, digits: int = 3) -> str:
    """1.97e10 -> '19.7 GB/s' (achieved bandwidth)."""
    return _scaled(b, "B/s", digits)


def gib(b: float, digits: int = 3) -> str:
    """Bytes as GiB (or MiB below one GiB): 2**31 -> '2 GiB', 2**24 -> '16 MiB'."""
    if abs(b) >= 2**30 or b == 0:
        return f"{_sig(b / 2**30, digits)} GiB"
    return f"{_sig(b / 2**20, digits)} MiB"


def percent(x: float, digits: int = 2) -> str:
    """A share with enough digits to be non-zero: 0.712 -> '71%', 0.0123 -> '1.2%',
    3.4e-5 -> '0.0034%'; exactly 0 and 1 print as '0%' and '100%'."""
    if not math.isfinite(x):
        return f"{x}"
    p = x * 100
    if p == 0 or abs(p) >= 10 ** digits:
        return f"{p:.0f}%"
    return f"{_sig(p, digits)}%"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """count(1, 'layer') -> '1 layer', count(3, 'layer') -> '3 layers'."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


__all__ = ["seconds", "bits_per_s", "bytes_per_s", "gib", "percent", "count"]
