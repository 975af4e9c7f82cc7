"""The `nn.Module` calls running in this thread, read from the Python call stack.

Where ToMe must start a forward that its model's pre-hook did not see start (a processor set with
`set_attn_processor` attaches at its first call; another thread attached while this one's forward ran), the
arguments the model and its blocks were called with are on the stack, in the frames of `nn.Module._call_impl`.
"""

from __future__ import annotations

from types import FrameType

import torch

_CALL_IMPL = torch.nn.Module._call_impl.__code__  # the frame of every `module(...)` call


def module_calls(frame: FrameType | None) -> list[tuple[torch.nn.Module, tuple, dict]]:
    """`(module, args, kwargs)` of every `nn.Module` call running in this thread from `frame` out, outermost first.

    Example:
        >>> import sys
        >>> module_calls(sys._getframe())  # no module is being called here
        []
    """
    calls = []
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            local = frame.f_locals
            module = local.get("self")
            if isinstance(module, torch.nn.Module):
                calls.append((module, tuple(local.get("args") or ()), dict(local.get("kwargs") or {})))
        frame = frame.f_back
    calls.reverse()
    return calls
