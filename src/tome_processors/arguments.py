"""Reading a call's arguments the way diffusers passes them: by keyword, or by position."""

from __future__ import annotations

from typing import Any


def argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    """The argument `name`, given by keyword or at `position` of `args` (a keyword wins); None if absent.

    Example:
        >>> argument((1, 2), {"mask": 3}, 1, "mask")
        3
        >>> argument((1, 2), {}, 1, "mask"), argument((1,), {}, 1, "mask")
        (2, None)
    """
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def replace_argument(args: tuple, kwargs: dict, position: int, name: str, value: Any) -> tuple[tuple, dict]:
    """`(args, kwargs)` with the argument `name` (by keyword, or at `position` of `args`) set to `value`.

    Example:
        >>> replace_argument((1, 2), {}, 1, "mask", 9)
        ((1, 9), {})
        >>> replace_argument((1,), {}, 1, "mask", 9)
        ((1,), {'mask': 9})
    """
    if name in kwargs or len(args) <= position:
        return args, {**kwargs, name: value}
    return (*args[:position], value, *args[position + 1 :]), kwargs
