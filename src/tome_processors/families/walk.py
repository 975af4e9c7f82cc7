"""One walk over a model's modules while ToMe resolves and installs its plan.

Turning ToMe on needs the model's modules several times: its family's blocks (a UNet's are found by structure), its
attention modules, their names, the levels its attention sits at. `one_walk(model)` walks `model.named_modules()`
once; inside it, `named_modules_of(model)` and `modules_of(model)` read that walk instead of walking again.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    >>> with one_walk(model) as walk:
    ...     named_modules_of(model) is walk, len(modules_of(model))
    (True, 2)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["modules_of", "named_modules_of", "one_walk"]

Walk = tuple[tuple[str, torch.nn.Module], ...]

_CURRENT = threading.local()


@contextmanager
def one_walk(model: torch.nn.Module, walk: Walk | None = None) -> Iterator[Walk]:
    """Inside, every walk over `model`'s modules (`named_modules_of`, `modules_of`) reads `walk` (one walk of
    `model.named_modules()`, made here where not given)."""
    walk = tuple(model.named_modules()) if walk is None else walk
    previous = getattr(_CURRENT, "walk", None)
    _CURRENT.walk = (model, walk)
    try:
        yield walk
    finally:
        _CURRENT.walk = previous


def named_modules_of(model: torch.nn.Module) -> Walk:
    """`(name, module)` of every module of `model`, in `named_modules()` order (inside `one_walk(model)`: its walk)."""
    current = getattr(_CURRENT, "walk", None)
    if current is not None and current[0] is model:
        return current[1]
    return tuple(model.named_modules())


def modules_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of `model`, in `modules()` order (inside `one_walk(model)`: from its walk)."""
    return [module for _, module in named_modules_of(model)]
