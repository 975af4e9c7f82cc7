"""The block-level merge context: forward hooks that fill and clear `ModelState` / `BlockState`.

Which blocks and attention modules get hooks, and where the token grid comes from, is the model
family's business (`families.py`). A call flows one way:
model pre-hook (token grid, timestep) -> block pre-hook (raw block input = the metric) ->
processors and feed-forward hooks (merge, run, unmerge) -> block post-hook (clear).
No forward is copied and no class is swapped; removing the handles restores the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .arguments import argument
from .config import ToMeConfig
from .context import SLOT_ATTR, AttentionSlot, BlockState, ModelState
from .families import BlockSite, Family, family_of

logger = logging.getLogger(__name__)

#: Attribute on the root model while ToMe is applied: its `ToMeContext`.
CONTEXT_ATTR = "_tome_context"


@dataclass
class ToMeContext:
    """Everything ToMe added to one model, so that removal can take exactly that away."""

    model_state: ModelState
    blocks: list[BlockState] = field(default_factory=list)
    slotted: list[torch.nn.Module] = field(default_factory=list)
    handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)

    def remove(self, model: torch.nn.Module) -> None:
        for handle in self.handles:
            handle.remove()
        for attn in self.slotted:
            if SLOT_ATTR in attn.__dict__:
                delattr(attn, SLOT_ATTR)
        for block in self.blocks:
            block.reset()
        self.handles.clear()
        self.slotted.clear()
        if CONTEXT_ATTR in model.__dict__:
            delattr(model, CONTEXT_ATTR)


def install(model: torch.nn.Module, config: ToMeConfig, family: Family | None = None) -> ToMeContext:
    """Install the merge context on `model`: a model pre-hook and hooks on every block of its family."""
    family = family or family_of(model)
    context = ToMeContext(
        ModelState(config=config, auto_downsample=family.auto_downsample(model), needs_row_token=family.needs_row_token)
    )
    state = context.model_state

    def model_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = argument(args, kwargs, family.input_position, family.input_name)
        grid = family.token_grid(module, args, kwargs) if isinstance(x, torch.Tensor) else None
        if grid is None:
            state.reset()
            return
        state.begin(grid, family.timestep(args, kwargs))

    context.handles.append(model.register_forward_pre_hook(model_pre_hook, with_kwargs=True))

    for index, site in enumerate(family.blocks(model)):
        block_state = BlockState(state, index)
        context.blocks.append(block_state)
        _install_block(context, site, block_state, config)
    logger.debug("ToMe hooks on %s (%s): %d blocks", type(model).__name__, family.name, len(context.blocks))
    return context


def _install_block(context: ToMeContext, site: BlockSite, block_state: BlockState, config: ToMeConfig) -> None:
    def block_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        block_state.reset()
        hidden_states = argument(args, kwargs, 0, "hidden_states")
        # The raw block input (image tokens), before norm1: tomesd's similarity metric.
        block_state.metric = hidden_states if isinstance(hidden_states, torch.Tensor) else None

    def block_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        block_state.reset()

    block = site.module
    context.handles.append(block.register_forward_pre_hook(block_pre_hook, with_kwargs=True))
    context.handles.append(block.register_forward_hook(block_post_hook, with_kwargs=True, always_call=True))

    for attention in site.attentions:
        setattr(attention.module, SLOT_ATTR, AttentionSlot(block_state, attention.is_cross, attention.layout))
        context.slotted.append(attention.module)

    if config.merge_mlp and site.feed_forward is not None:
        _install_feed_forward(context, site.feed_forward, block_state, config)


def _install_feed_forward(
    context: ToMeContext, ff: torch.nn.Module, block_state: BlockState, config: ToMeConfig
) -> None:
    # The feed-forward is no attention module, so it gets a pre-hook (merge) and a hook (unmerge).
    def ff_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        block_state.ff_merge = None
        hidden_states = argument(args, kwargs, 0, "hidden_states")
        merge = block_state.merge_for(config)
        # Chunked feed-forward (set_chunk_feed_forward) sees slices: leave those alone.
        if merge is None or not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 3:
            return None
        if (merge.batch, merge.num_tokens) != tuple(hidden_states.shape[:2]):
            return None
        block_state.ff_merge = merge
        merged = merge.merge(hidden_states)
        if args:
            return (merged, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": merged}

    def ff_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        merge, block_state.ff_merge = block_state.ff_merge, None
        if merge is None or not isinstance(output, torch.Tensor):  # output is None after an exception
            return None
        return merge.unmerge(output)

    context.handles.append(ff.register_forward_pre_hook(ff_pre_hook, with_kwargs=True))
    context.handles.append(ff.register_forward_hook(ff_post_hook, with_kwargs=True, always_call=True))
