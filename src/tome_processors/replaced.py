"""Attention modules whose `forward` something else replaced: no attention processor runs there, ToMe's included.

An attention module's class `forward` hands its work to `attn.processor`, which is where ToMe merges. A tool that
sets a `forward` of its own on the module (T-GATE's `register_forward` sets one on every `Attention` of the UNet,
at each pipeline call) or patches the class's runs its own attention instead: ToMe cannot merge there. Wrappers
that still call the class's `forward` (accelerate's offload hooks, diffusers' hook registry: each keeps the
forward it wraps as `__wrapped__`) are no replacement.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Iterable

import torch

from .families.walk import named_modules_of

#: Models already told (once per model).
_TOLD: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


@functools.cache
def _patched_class_forward(module_type: type) -> str | None:
    """Where `module_type.forward` is no function its defining class wrote: its name; else None."""
    for cls in module_type.__mro__:
        forward = vars(cls).get("forward")
        if forward is None:
            continue
        function = inspect.unwrap(forward) if callable(forward) else forward
        qualname = getattr(function, "__qualname__", "")
        return None if qualname == f"{cls.__qualname__}.forward" else qualname or repr(function)
    return None


def _calls_class_forward(module: torch.nn.Module, forward: object) -> bool:
    """Whether `forward`, an instance attribute of `module`, wraps its class's `forward`: itself bound, or through
    `__wrapped__` (accelerate's and diffusers' hooks wrap the forward with `functools.update_wrapper`)."""
    target = type(module).forward
    seen = 0
    current = forward
    while current is not None and seen < 32:
        if current is target or getattr(current, "__func__", None) is target:
            return True
        seen += 1
        current = getattr(current, "__wrapped__", None)
    return False


def replaced_forward(module: torch.nn.Module) -> str | None:
    """Why calling `module` runs no processor: its `forward` replaced on the instance or patched on its class (said
    in words); None where its class's `forward` runs.

    Example:
        >>> from diffusers.models.attention_processor import Attention
        >>> attn = Attention(query_dim=8)
        >>> replaced_forward(attn) is None
        True
        >>> attn.forward = lambda hidden_states, **kwargs: hidden_states
        >>> replaced_forward(attn)
        'an instance attribute `forward` (<lambda>)'
    """
    forward = vars(module).get("forward")
    if forward is not None and not _calls_class_forward(module, forward):
        return f"an instance attribute `forward` ({getattr(forward, '__qualname__', type(forward).__name__)})"
    patched = _patched_class_forward(type(module))
    if patched is not None:
        return f"{type(module).__name__}.forward patched to {patched}"
    return None


def warn_replaced_forwards(model: torch.nn.Module, modules: Iterable[torch.nn.Module], stacklevel: int = 2) -> None:
    """Warn once per `model` where any of `modules`, attention modules ToMe would merge in, runs a `forward` that
    calls no processor (`replaced_forward`), naming them and the cause."""
    if model in _TOLD:
        return
    modules = list(modules)
    causes = [(module, cause) for module in modules if (cause := replaced_forward(module)) is not None]
    if not causes:
        return
    _TOLD.add(model)
    names = {module: name for name, module in named_modules_of(model)}
    listed = ", ".join(names.get(module, type(module).__name__) for module, _ in causes[:3])
    more = f" and {len(causes) - 3} more" if len(causes) > 3 else ""
    warnings.warn(
        f"ToMe merges no attention in {len(causes)} of the {len(modules)} attention modules it merges in on "
        f"{type(model).__name__} ({listed}{more}): their forward is {causes[0][1]}, which calls no attention "
        "processor, so ToMe's does not run there (T-GATE's register_forward replaces every Attention's forward this "
        "way). What runs there is that forward's own attention; of ToMe only its block hooks and, with "
        "merge_mlp=True, the feed-forward merge still run. (Said once per model.)",
        UserWarning,
        stacklevel=stacklevel + 1,
    )
