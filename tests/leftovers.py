"""What ToMe could leave behind on a model: shared by the removal tests."""

from __future__ import annotations

import torch


def hooks_left(model: torch.nn.Module) -> int:
    """Torch hooks, diffusers hook registries and instance `forward`s (none of which these models start with)."""
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + ("_diffusers_hook" in vars(m)) + ("forward" in vars(m))
        for m in model.modules()
    )


def tome_attributes_left(model: torch.nn.Module) -> list[str]:
    """Attributes named `_tome...` on any submodule, and methods ToMe wrapped on an instance (`keeper.py`)."""
    return [
        name
        for m in model.modules()
        for name, value in vars(m).items()
        if name.startswith("_tome") or type(value).__module__ == "tome_processors.keeper"
    ]
