"""The block-level merge context: hooks that fill and clear `ModelState` / `BlockState`.

Which blocks and attention modules get hooks, and where the token grid comes from, is the model
family's business (`families.py`). A call flows one way:
model pre-hook (token grid, timestep) -> block pre-hook (raw block input = the metric) ->
processors and feed-forward hooks (merge, run, unmerge) -> block post-hook (clear).
No forward is copied and no class is swapped; removing the hooks restores the model.

Two kinds of hook, each where it serves:

- The forward path uses plain torch module hooks. They compose with anything else that rewrites
  a module's `forward`: accelerate's model offload takes its hook off and puts it back after every
  pipeline call, restoring the `forward` it saw first, which silently drops a diffusers
  `HookRegistry` wrapper installed after it (checked: such a hook ran in the first pipeline call
  only). Post-hooks with `always_call=True` clear a block's tensors even when the block raises.
- One named, stateful diffusers `ModelHook` on the model holds the `ModelHooks` (no attribute of
  our own on the model) and gets diffusers' reset: pipelines end `__call__` with
  `maybe_free_model_hooks()`, which resets the denoisers that have `_reset_stateful_cache` (Flux's).
  Nothing depends on that end: a generation's start is seen by the model pre-hook (a new generation
  marker, `Family.generation_marker`) and by the pipeline's `progress_bar` (`watch_schedule`).
  Its forward wrapper does nothing, so losing it to a rewrite of `forward` costs nothing.

The model pre-hook also stands the context down: when no attention module of the model holds a
ToMe processor any more (`model.set_attn_processor(AttnProcessor2_0())` after ToMe), it removes
everything ToMe installed, so nothing of ToMe runs from that forward on.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention
from diffusers.utils.torch_utils import unwrap_module

from ._similarity import is_compiling
from .arguments import argument
from .config import ToMeConfig
from .context import SLOT_ATTR, AttentionSlot, BlockState, HostSchedule, ModelState
from .families import BlockSite, Family, Span, attention_levels, class_default_processor, family_of
from .merge import release_buffers

logger = logging.getLogger(__name__)

#: Name of ToMe's hook in the model's diffusers `HookRegistry`.
HOOK_NAME = "tome"
_REGISTRY_ATTR = "_diffusers_hook"  # where diffusers keeps a module's `HookRegistry`
_MISSING = object()


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every attention module of `model` that holds a processor, in module order."""
    # `Attention` (UNets, PixArt, SD3) and the newer `AttentionModuleMixin` modules (FluxAttention).
    return [m for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin)) and hasattr(m, "processor")]


def warn_if_merges_nothing(model: torch.nn.Module, config: ToMeConfig, stacklevel: int) -> None:
    """Warn when `config` cannot merge anything on `model` (its levels are skipped, or every merge is off)."""
    levels = attention_levels(model)
    if config.max_downsample != "auto" and levels and config.max_downsample < min(levels):
        warnings.warn(
            f"ToMe with max_downsample={config.max_downsample} merges nothing on {type(model).__name__}: its "
            f"attention starts at downsample {min(levels)}. Use max_downsample='auto' or >= {min(levels)}.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    elif config.ratio == 0 or not (config.merge_attn or config.merge_crossattn or config.merge_mlp):
        warnings.warn(
            "ToMe with this configuration merges nothing (ratio 0 or every merge flag off).", stacklevel=stacklevel + 1
        )


class ModelHooks:
    """The merge context as installed on one model: its hooks, slots and state, so that removal can take
    exactly that away (`context_of(model)` finds it).

    Attributes:
        model_state: the state the hooks fill and the processors read.
        family: the model's family (where its blocks, token grid and timestep are).
        processor_type: the processor class that reads the slots; while no attention module holds
            one, the context stands down.
        blocks: one `BlockState` per block of the family, in order, beside `block_modules`.
        watched: every attention module of the model (for the stand-down check).
        slotted: the attention modules given an `AttentionSlot`.
    """

    def __init__(self, model_state: ModelState, family: Family, processor_type: type) -> None:
        self.model_state = model_state
        self.family = family
        self.processor_type = processor_type
        self.blocks: list[BlockState] = []
        self.block_modules: list[torch.nn.Module] = []
        self.watched: list[torch.nn.Module] = []
        self.slotted: list[torch.nn.Module] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.hook: _ContextHook | None = None
        self.created_registry = False
        self.schedule: HostSchedule | None = None  # this generation's timesteps, for `ratio_start`

    def begin(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Start a forward of `model` called with `args` / `kwargs`: its token grid and timestep."""
        family, state = self.family, self.model_state
        grid = family.token_grid(model, args, kwargs)  # None where the call gives no grid (each family checks)
        if grid is None:
            state.reset()
            return
        value = None
        if state.config.ratio_start is not None and self.schedule is not None:
            # The argument as passed (a view of the schedule), not the family's rescaled copy.
            value = self.schedule.value_for(argument(args, kwargs, family.timestep_position, "timestep"))
        # Only reuse across steps (`recompute_every`) carries anything from one forward into the next.
        marker = family.generation_marker(args, kwargs) if state.config.recompute_every > 1 else None
        # A video family's grid is `(frames, h, w)`.
        frames = grid[0] if len(grid) == 3 else 1
        state.begin(grid[-2:], family.timestep(args, kwargs), value, marker, frames)

    def block_of(self, module: torch.nn.Module) -> BlockState | None:
        for block_module, block in zip(self.block_modules, self.blocks, strict=True):
            if block_module is module:
                return block
        return None

    def holds_processor(self) -> bool:
        """Whether some attention module still holds a ToMe processor (identity and type checks only)."""
        kind = self.processor_type
        # Stops at the first hit: while ToMe is on, that is the first module.
        return any(isinstance(getattr(attn, "processor", None), kind) for attn in self.watched)

    def reset(self) -> None:
        """Forget the current generation: token grid, step count, kept merges, block inputs, timesteps."""
        self.schedule = None
        self.model_state.reset()
        for block in self.blocks:
            block.reset()

    def remove(self, model: torch.nn.Module) -> None:
        """Take away every hook, slot and registry entry ToMe added to `model`."""
        model = unwrap_module(model)  # hooks and registry sit on the module `torch.compile` wraps
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for attn in self.slotted:
            if SLOT_ATTR in attn.__dict__:
                delattr(attn, SLOT_ATTR)
        self.slotted.clear()
        self.reset()
        if self.hook is not None:
            _unregister(model, self.hook, self.created_registry)
            self.hook = None
        release_buffers()  # the merges' zero tensors (device memory); another model's merges make theirs again

    def stand_down(self, model: torch.nn.Module) -> None:
        """No ToMe processor is left in `model`: take everything away (or, while compiling, merge nothing)."""
        if is_compiling():  # hooks cannot be taken off inside a traced graph
            self.reset()
            return
        self.remove(model)
        logger.debug("ToMe stood down on %s: no attention module holds a ToMe processor", type(model).__name__)


class _ContextHook(ModelHook):
    """ToMe's entry in the model's `HookRegistry`: holds the context; resets it between generations."""

    _is_stateful = True

    def __init__(self, context: ModelHooks) -> None:
        super().__init__()
        self.context = context
        self.wrapper: Any = None  # the `forward` the registry set on the model

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.context.reset()
        return module


def _registry(model: torch.nn.Module) -> HookRegistry | None:
    registry = getattr(model, _REGISTRY_ATTR, None)  # getattr: reaches through torch.compile's wrapper
    return registry if isinstance(registry, HookRegistry) else None


def context_of(model: torch.nn.Module) -> ModelHooks | None:
    """The `ModelHooks` installed on `model`, or None."""
    registry = _registry(model)
    hook = registry.get_hook(HOOK_NAME) if registry is not None else None
    return hook.context if isinstance(hook, _ContextHook) else None


def _register(model: torch.nn.Module, context: ModelHooks) -> None:
    context.created_registry = _REGISTRY_ATTR not in model.__dict__
    hook = _ContextHook(context)
    HookRegistry.check_if_exists_or_initialize(model).register_hook(hook, HOOK_NAME)
    hook.wrapper = model.__dict__.get("forward")
    context.hook = hook


def _unregister(model: torch.nn.Module, hook: _ContextHook, created_registry: bool) -> None:
    registry = model.__dict__.get(_REGISTRY_ATTR)
    if not isinstance(registry, HookRegistry) or registry.get_hook(HOOK_NAME) is not hook:
        return
    current = model.__dict__.get("forward", _MISSING)
    registry.remove_hook(HOOK_NAME, recurse=False)
    if current is not hook.wrapper:
        # Something rewrote `forward` after us (accelerate's offload): the registry would put back
        # what it saw at registration, so keep what is there now.
        if current is _MISSING:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = current
    restored = model.__dict__.get("forward")
    if getattr(restored, "__self__", None) is model and getattr(restored, "__func__", None) is type(model).forward:
        del model.__dict__["forward"]  # the registry leaves the class's own forward as an instance attribute
    if created_registry and not registry.hooks:
        del model.__dict__[_REGISTRY_ATTR]


def install(model: torch.nn.Module, config: ToMeConfig, family: Family | None, processor_type: type) -> ModelHooks:
    """Install the merge context on `model`: a model pre-hook and hooks on every block of its family.

    `processor_type` is the processor class that reads the slots: the context stands down at the
    first forward in which no attention module of `model` holds one.
    """
    model = unwrap_module(model)
    family = family or family_of(model)
    state = ModelState(
        config=config,
        auto_downsample=family.auto_downsample(model),
        needs_row_token=family.needs_row_token,
        rotary=family.rotary,
        masks_text_only=family.masks_text_only,
    )
    context = ModelHooks(state, family, processor_type)
    context.watched = attention_modules(model)

    def model_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not context.holds_processor():
            context.stand_down(module)
            return
        context.begin(module, args, kwargs)

    context.handles.append(model.register_forward_pre_hook(model_pre_hook, with_kwargs=True))
    for index, site in enumerate(family.blocks(model)):
        block_state = BlockState(state, index)
        context.blocks.append(block_state)
        context.block_modules.append(site.module)
        _install_block(context, site, block_state, config)
    _register(model, context)
    logger.debug("ToMe hooks on %s (%s): %d blocks", type(model).__name__, family.name, len(context.blocks))
    return context


def enter_block(block_state: BlockState, args: tuple, kwargs: dict, site: BlockSite | None = None) -> None:
    """Start a block's forward: its raw input (image tokens, before norm1) is tomesd's similarity metric.

    Where the block's input holds other tokens too (`site.span`), the metric is the grid's tokens of it.
    """
    block_state.reset()
    hidden_states = argument(args, kwargs, 0, "hidden_states")
    if not isinstance(hidden_states, torch.Tensor):
        block_state.metric = None
        return
    latent_hw = block_state.model.latent_hw
    if site is not None and latent_hw is not None:
        hidden_states = site.metric(hidden_states, latent_hw[0] * latent_hw[1])
    block_state.metric = hidden_states


def _install_block(context: ModelHooks, site: BlockSite, block_state: BlockState, config: ToMeConfig) -> None:
    span_site = site if site.span is not Span.WHOLE else None

    def block_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        enter_block(block_state, args, kwargs, span_site)

    def block_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        block_state.reset()

    block = site.module
    context.handles.append(block.register_forward_pre_hook(block_pre_hook, with_kwargs=True))
    context.handles.append(block.register_forward_hook(block_post_hook, with_kwargs=True, always_call=True))

    for attention in site.attentions:
        built_with = attention.built_with or context.family.built_with or class_default_processor(attention.module)
        slot = AttentionSlot(
            block_state,
            attention.is_cross,
            attention.layout,
            built_with,
            mask_at=attention.mask_at,
            rotary_at=attention.rotary_at,
        )
        setattr(attention.module, SLOT_ATTR, slot)
        context.slotted.append(attention.module)

    if config.merge_mlp and site.feed_forward is not None:
        _install_feed_forward(context, site.feed_forward, block_state, config)


def _install_feed_forward(
    context: ModelHooks, ff: torch.nn.Module, block_state: BlockState, config: ToMeConfig
) -> None:
    # The feed-forward is no attention module, so it gets a pre-hook (merge) and a hook (unmerge).
    def ff_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        block_state.ff_merge = None
        hidden_states = argument(args, kwargs, 0, "hidden_states")
        merge = block_state.merge_for(config, text=None)  # the attention's merge, whatever its positions
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


def set_timestep_schedule(model: torch.nn.Module, timesteps: torch.Tensor | None) -> None:
    """Give ToMe on `model` the timesteps of the coming generation, so `ratio_start` reads no timestep.

    With `ratio_start` the merged shape follows the timestep, which ToMe otherwise reads back from the
    device once per forward. Given the schedule, it copies it to the host once, here, and finds each
    forward's timestep in it by where that tensor sits (see `HostSchedule`): call the model with the
    schedule's entries (`for t in scheduler.timesteps`), or views of them. A forward called otherwise
    reads its timestep as before. Pipelines with ToMe applied (`apply_tome(pipe)`, `enable_tome`) do
    this themselves. Giving a schedule also starts a new generation (as `new_generation`). The schedule
    is dropped at a reset of ToMe's state (a new generation) or with `None`.

    Args:
        model: a model with ToMe applied.
        timesteps: `scheduler.timesteps` after `scheduler.set_timesteps(...)`, or None.

    Example:
        >>> scheduler.set_timesteps(30)  # doctest: +SKIP
        >>> tome_processors.set_timestep_schedule(unet, scheduler.timesteps)  # doctest: +SKIP
        >>> for t in scheduler.timesteps:  # doctest: +SKIP
        ...     noise = unet(latents, t, text).sample
    """
    context = context_of(model)
    if context is None:
        raise ValueError(f"Expected a model with ToMe applied, but got {type(model).__name__} without it.")
    schedule = HostSchedule(timesteps) if timesteps is not None else None  # checked before anything changes
    context.reset()
    context.schedule = schedule


#: Marks the `progress_bar` that `watch_schedule` put on a pipeline (and holds what it replaced).
_WATCHING = "_tome_replaced"


def watch_schedule(pipeline: Any, models: Sequence[torch.nn.Module]) -> None:
    """Start a new generation on `models` at the start of every denoising loop of `pipeline`.

    Every diffusers pipeline opens its denoising loop with `self.progress_bar(...)`, after
    `scheduler.set_timesteps` (and img2img's `set_begin_index`): wrapped on the instance, it resets the
    state ToMe keeps across steps (`recompute_every`) there, however the last call ended (a callback or
    `KeyboardInterrupt` that stopped it midway), and for the models whose configuration has
    `ratio_start` copies `pipeline.scheduler.timesteps` to the host, once per generation and outside any
    forward. Watching again replaces an earlier watch; without a model with ToMe nothing is wrapped.
    """
    unwatch_schedule(pipeline)
    models = list(models)
    original = getattr(pipeline, "progress_bar", None)
    if not callable(original) or all(context_of(model) is None for model in models):
        return
    own = pipeline.__dict__.get("progress_bar")  # an instance attribute there before us, put back after

    @functools.wraps(original)
    def progress_bar(*args: Any, **kwargs: Any) -> Any:
        _start_generation(pipeline, models)
        return original(*args, **kwargs)

    setattr(progress_bar, _WATCHING, (own,))
    object.__setattr__(pipeline, "progress_bar", progress_bar)


def unwatch_schedule(pipeline: Any) -> None:
    """Undo `watch_schedule` (nothing when the pipeline is not watched)."""
    wrapper = getattr(pipeline, "__dict__", {}).get("progress_bar")
    watched = getattr(wrapper, _WATCHING, None)
    if watched is None:
        return
    (own,) = watched
    if own is None:
        del pipeline.__dict__["progress_bar"]
    else:
        pipeline.__dict__["progress_bar"] = own


def _start_generation(pipeline: Any, models: list[torch.nn.Module]) -> None:
    contexts = [c for c in map(context_of, models) if c is not None]
    for context in contexts:
        context.reset()
    contexts = [c for c in contexts if c.model_state.config.ratio_start is not None]
    if not contexts:
        return
    timesteps = getattr(getattr(pipeline, "scheduler", None), "timesteps", None)
    schedule = None
    if isinstance(timesteps, torch.Tensor) and timesteps.ndim == 1:
        schedule = HostSchedule(timesteps, pipeline)  # one copy for every model of the pipeline
    for context in contexts:
        context.schedule = schedule
