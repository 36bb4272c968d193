"""Numeric bounds of config fields, declared once in the schema as field metadata.

``batch_size: int = field(default=8, metadata=at_least(1))``: `load_config` rejects a value outside
the bounds before anything starts, naming the field, the value and the bound (the launcher's check
run loads the whole config this way, so the error comes before any server starts). A field that
may be ``None`` (an optional setting) is only checked when it holds a number. Here and not in
`areal_lite.api.config` because the config dataclasses of `areal_lite.api.io` carry bounds too.
"""

from __future__ import annotations

from dataclasses import fields


def at_least(low: float) -> dict[str, float]:
    """Field metadata: the value must be ``>= low``."""
    return {"ge": low}


def more_than(low: float) -> dict[str, float]:
    """Field metadata: the value must be ``> low``."""
    return {"gt": low}


def between(low: float, high: float) -> dict[str, float]:
    """Field metadata: the value must lie in ``[low, high]``."""
    return {"ge": low, "le": high}


_TESTS = (
    ("ge", ">=", lambda v, b: v >= b),
    ("gt", ">", lambda v, b: v > b),
    ("le", "<=", lambda v, b: v <= b),
)


def out_of_bounds(metadata: dict[str, object], value: object) -> str | None:
    """What is wrong with ``value`` under the bounds in ``metadata`` (``"must be >= 1"``), or None
    when it is within them, has no bounds, or is not a number (None: an unset optional field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    for key, sign, holds in _TESTS:
        bound = metadata.get(key)
        if bound is not None and not holds(value, bound):
            return f"must be {sign} {bound}"
    return None


def check_bounds(obj: object) -> None:
    """ValueError naming the first field of the dataclass ``obj`` outside its bounds: for
    dataclasses also built in code, which `load_config` does not see."""
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        problem = out_of_bounds(dict(f.metadata), value)
        if problem is not None:
            raise ValueError(f"{type(obj).__name__}.{f.name} is {value!r}; it {problem}")
