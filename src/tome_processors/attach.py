"""Attach the merge context for processors set with `set_attn_processor(ToMeProcessor())`.

A processor cannot see the model it is set on, and the merge needs model-level facts (the latent
size, the raw block input). So a new `ToMeProcessor` is "pending": a process-wide forward pre-hook
waits for the first diffusers model that is called with a pending processor inside, installs the
hooks on it (as `apply_tome` would), and removes itself once nothing is pending.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .processor import ToMeProcessor

logger = logging.getLogger(__name__)

_pending: weakref.WeakSet[ToMeProcessor] = weakref.WeakSet()
_lock = threading.Lock()
_handle: torch.utils.hooks.RemovableHandle | None = None


def register_pending(processor: ToMeProcessor) -> None:
    """Mark `processor` as waiting for a model to attach to."""
    global _handle
    with _lock:
        _pending.add(processor)
        if _handle is None:
            _handle = torch.nn.modules.module.register_module_forward_pre_hook(_attach_pre_hook)


def discard_pending(processors) -> None:
    """Processors that `apply_tome` bound to a model need no attaching."""
    global _handle
    with _lock:
        for processor in processors:
            _pending.discard(processor)
        if not _pending and _handle is not None:
            _handle.remove()
            _handle = None


def _attach_pre_hook(module: torch.nn.Module, args: tuple) -> None:
    from diffusers import ModelMixin  # noqa: PLC0415

    if not isinstance(module, ModelMixin) or not _pending:
        return None
    from .apply import attach_processors  # noqa: PLC0415

    found = [m.processor for m in module.modules() if getattr(m, "processor", None) in _pending]
    if not found:
        return None
    if not attach_processors(module, found, args):
        warnings.warn(
            f"ToMe attached to {type(module).__name__} during a call that passed its inputs by keyword; this "
            "forward ran without merging. Call tome_processors.apply_tome(model) before the first forward "
            "to merge from the start.",
            stacklevel=2,
        )
    return None
