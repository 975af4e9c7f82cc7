"""Attention's share of a forward: the time spent inside the attention modules (their processors, ToMe's
merge and unmerge included) over the time of the whole forward, for `tome-processors bench`.

It bounds what merging for attention alone can give: at a share `a`, removing all of attention's work
speeds a forward up by at most `1 / (1 - a)`. Measured in a forward of its own (hooks around every attention
module; on CUDA each hook waits for the device, so that forward is not one of the timed ones).

Example:
    >>> from tome_processors.bench.dit import build_transformer, make_transformer_inputs
    >>> model = build_transformer("wan", quick=True)
    >>> inputs = make_transformer_inputs(model, "wan", 1, 64, frames=5, width=64)
    >>> 0 < attention_share(model, inputs.run) < 1
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..hooks import attention_modules
from .engine import Method

__all__ = ["attention_share", "attention_share_metrics"]

#: The column of `attention_share_metrics`.
ATTENTION_COLUMN = "attention %"


def attention_share(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any]) -> float:
    """The share of one `forward(model)`'s time spent inside `model`'s attention modules."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    spent = [0.0]
    started: list[float] = []

    def pre_hook(module: torch.nn.Module, args: tuple) -> None:
        started.append(now())

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        spent[0] += now() - started.pop()

    handles = []
    for attn in attention_modules(model):
        handles.append(attn.register_forward_pre_hook(pre_hook))
        handles.append(attn.register_forward_hook(hook))
    try:
        begin = now()
        forward(model)
        total = now() - begin
    finally:
        for handle in handles:
            handle.remove()
    return spent[0] / total


def attention_share_metrics(
    model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any]
) -> Callable[[Method], dict[str, float]]:
    """A bench `extra_metrics` callable: each method's attention share (in percent) in one forward of `model`."""

    def measure(method: Method) -> dict[str, float]:
        method.apply(model)
        try:
            forward(model)  # caches filled, as in every timed forward
            return {ATTENTION_COLUMN: 100 * attention_share(model, forward)}
        finally:
            method.remove(model)

    return measure
