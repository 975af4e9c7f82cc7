"""The block-level merge context: hooks that fill and clear `ModelState` / `BlockState`.

Which blocks and attention modules get hooks, and where the token grid comes from, is the model
family's business (`families.py`). A call flows one way:
model pre-hook (token grid, timestep) -> block pre-hook (raw block input = the metric) ->
processors and feed-forward hooks (merge, run, unmerge) -> block post-hook (clear).
No forward is copied and no class is swapped; removing the hooks restores the model.

All of it runs on plain torch module hooks, which compose with anything else that rewrites a
module's `forward` (accelerate's offload puts its own `forward` back after every pipeline call). The
hooks are small objects rather than closures, and the model's pre-hook holds the `ModelHooks`
(`context_of` finds it there, no attribute of our own on the model): `copy.deepcopy` of a model with
ToMe gives a model with ToMe of its own (its hooks see the copy's blocks), and `pickle` / `torch.save`
store it. A diffusers `HookRegistry` entry could not do that: it replaces `forward` with a function
bound to the original module, which a copy would keep calling. Post-hooks with `always_call=True`
clear a block's tensors even when the block raises.

The model pre-hook also stands the context down: when no attention module of the model holds a
ToMe processor any more (`model.set_attn_processor(AttnProcessor2_0())` after ToMe), it removes
everything ToMe installed, so nothing of ToMe runs from that forward on.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.utils.torch_utils import unwrap_module

from ._similarity import is_compiling
from .arguments import argument
from .calls import module_calls
from .config import ToMeConfig
from .context import SLOT_ATTR, AttentionSlot, BlockSlot, BlockState, ForwardStates, HostSchedule, ModelState
from .families import (
    BlockSite,
    Family,
    Layout,
    Span,
    attention_levels,
    class_default_processor,
    family_of,
    is_attention_module,
)
from .families.walk import modules_of, named_modules_of, one_walk
from .keeper import ProcessorKeeper, all_unwrapped
from .merge import release_buffers
from .parallel import LocalGrid, Shards, local_grid, sequence_shards, uneven_split
from .pays import SiteShape, decide, group_of, site_shapes
from .plan import ToMePlan
from .replaced import warn_replaced_forwards
from .skips import Skip, report_skip

logger = logging.getLogger(__name__)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every attention module of `model` that holds a processor, in module order."""
    return [m for m in modules_of(model) if is_attention_module(m)]


def warn_if_merges_nothing(
    model: torch.nn.Module,
    config: ToMeConfig,
    stacklevel: int,
    family: Family | None = None,
    sites: Sequence[BlockSite] | None = None,
) -> None:
    """Warn when `config` cannot merge anything on `model` (its levels are skipped, or every merge is off),
    and for each option that has no effect on the model's family (whose block `sites` the caller may know)."""
    family = family or family_of(model)
    sites = family.blocks(model) if sites is None else sites
    name = type(model).__name__
    found = attention_levels(model)
    levels = found or [1]  # a transformer's blocks all sit at the latent's grid
    if getattr(model, "down_blocks", None) and not found and not config.merge_crossattn:
        # A UNet whose blocks all attend to the text only (`only_cross_attention`): no self-attention to merge.
        warnings.warn(
            f"ToMe merges no attention on {name}: none of its blocks attends over the image tokens (each attends "
            "to the text only, only_cross_attention). merge_crossattn=True merges their queries.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    if config.level_ratios is not None and not any(config.level_ratio(level, 1) > 0 for level in levels):
        warnings.warn(
            f"ToMe with level_ratios={dict(config.level_ratios)} merges nothing on {name}: its attention sits at "
            f"downsample level(s) {levels}. Give a ratio for one of them, e.g. level_ratios={{{levels[0]}: 0.5}}.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    elif config.level_ratios is None and config.max_downsample != "auto" and config.max_downsample < min(levels):
        warnings.warn(
            f"ToMe with max_downsample={config.max_downsample} merges nothing on {name}: its "
            f"attention starts at downsample {min(levels)}. Use max_downsample='auto' or >= {min(levels)}.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    elif config.ratio == 0 or not (config.merge_attn or config.merge_crossattn or config.merge_mlp):
        warnings.warn(
            "ToMe with this configuration merges nothing (ratio 0 or every merge flag off).", stacklevel=stacklevel + 1
        )
    if config.merge_crossattn and not any(a.is_cross for site in sites for a in site.attentions):
        warnings.warn(
            f"ToMe's merge_crossattn=True has no effect on {name}: it has no cross-attention over image tokens "
            "(its text and image tokens meet in joint attention, which merge_attn covers).",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


class ModelHooks:
    """The merge context as installed on one model: its hooks, slots and state, so that removal can take
    exactly that away (`context_of(model)` finds it).

    Attributes:
        plan: what turning ToMe on resolved (`plan.ToMePlan`): the family, the configuration, the sites.
        states: each thread's state the hooks fill and the processors read (`ForwardStates`): concurrent forwards
            of the model, one per thread, each have their own.
        family: the model's family (where its blocks, token grid and timestep are).
        processor_type: the processor class that reads the slots; while no attention module holds
            one, the context stands down.
        block_modules: the blocks of the family, in order (this thread's `BlockState` of each: `blocks`).
        watched: every attention module of the model (for the stand-down check).
        slotted: the attention modules given an `AttentionSlot`.
    """

    def __init__(self, model: torch.nn.Module, template: ModelState, plan: ToMePlan, processor_type: type) -> None:
        self.model = model
        self.plan = plan
        self.states = ForwardStates(template, len(plan.sites), functools.partial(_begin_mid_forward, self))
        self.family = plan.family
        self.processor_type = processor_type
        self.block_modules: list[torch.nn.Module] = []
        self.sites: tuple[BlockSite, ...] = plan.sites  # beside `block_modules`
        self.watched: list[torch.nn.Module] = []
        self.slotted: list[torch.nn.Module] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        #: Keeps the processors wrapped through diffusers' own processor swaps (fusing, IP-Adapter loading, ...).
        self.keeper: ProcessorKeeper | None = None
        self.warned_small_grid = False
        #: The parallel config last seen on the model and how it splits the tokens (`parallel.py`), read once per
        #: config rather than per forward; the config handed to the processors ToMe builds (None without).
        self._parallel_seen: Any = None
        self._shards: Shards | None = None
        self._parallel_config: Any = None
        #: Each block's static shape (level, width), for `pays_only` (pays.py).
        self.shapes: tuple[SiteShape, ...] = ()
        #: `pays_only`'s decisions made so far: `((grid, frames, device type), factors)` pairs, replaced, not mutated.
        self.decisions: tuple = ()

    def __getstate__(self) -> dict:
        # A copy starts a generation of its own (`ForwardStates` copies no thread's state). The parallel config
        # (device meshes) is read again from the copy's model at its first forward.
        fresh = {"decisions": (), "_parallel_seen": None, "_shards": None, "_parallel_config": None}
        return {**vars(self), **fresh}

    @property
    def model_state(self) -> ModelState:
        """This thread's state of the model's forwards."""
        return self.states.current

    @property
    def blocks(self) -> list[BlockState]:
        """This thread's state of each block, in order, beside `block_modules`."""
        return self.states.current.blocks

    @property
    def schedule(self) -> HostSchedule | None:
        """This thread's generation's timesteps on the host, for `ratio_start`."""
        return self.model_state.schedule

    @schedule.setter
    def schedule(self, schedule: HostSchedule | None) -> None:
        self.model_state.schedule = schedule

    @property
    def grid_hint(self) -> tuple[int, int] | None:
        """This thread's generation's token grid as its pipeline made it, for a compiled forward."""
        return self.model_state.grid_hint

    @grid_hint.setter
    def grid_hint(self, grid: tuple[int, int] | None) -> None:
        self.model_state.grid_hint = grid

    def begin(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Start a forward of `model` called with `args` / `kwargs`: its token grid and timestep."""
        family, state = self.family, self.model_state
        state.forward_skip = None
        shards = self._sequence_shards(model)
        state.parallel_config = self._parallel_config
        if state.grid_hint is not None and is_compiling():
            grid = family.hinted_grid(model, args, kwargs, state.grid_hint)
        else:
            grid = family.token_grid(model, args, kwargs)  # None where the call gives no grid (each family checks)
        if grid is None:
            state.reset()
            state.forward_skip = Skip.NO_MODEL_GRID  # what each attention ToMe merges in says (once per model)
            return
        # A video family's grid is `(frames, h, w)`.
        frames = grid[0] if len(grid) == 3 else 1
        whole_grid, whole_frames = grid[-2:], frames  # the pays rule decides on what the model generates
        tail = family.trailing_tokens(args, kwargs, grid)
        shard = None
        if shards is not None:  # context parallelism: this rank's blocks see one run of the tokens
            # Tokens the blocks get ahead of the grid's, split with it as one sequence (MiniMax-H3's text and audio)
            lead = family.leading_tokens(args, kwargs, grid)
            # Image tokens beyond the grid's that the family passes through (Qwen-Image-Edit's reference image)
            # split with it as one sequence, as a tail does.
            if lead is None:
                tail = tail or self._tokens_beyond_grid(args, kwargs, frames * grid[-2] * grid[-1])
            shard = self._local_grid(model, grid[-2:], frames, shards, tail, lead or 0)
            if shard is None:
                state.reset()
                state.forward_skip = Skip.SHARD  # said once by `_local_grid`; the attentions say no more
                return
            grid, frames = (shard.h, shard.w), shard.frames  # and `shard.extra`: `BlockState.grid` reads it
        if not is_compiling() and not self.warned_small_grid and (grid[-2:], frames) != (state.latent_hw, state.frames):
            self._warn_if_too_small(model, grid[-2:], frames)  # once per grid, not every step
        paying = None
        if state.config.pays_only:
            paying = self.paying(whole_grid, whole_frames, self._device_type(model, args, kwargs))
            if not any(paying):  # merging pays in no block: every hook and processor passes straight through
                state.begin_idle(grid[-2:], frames, paying)
                state.shard = shard
                return
        value = None
        if state.config.ratio_start is not None and state.schedule is not None:
            # The argument as passed (a view of the schedule), not the family's rescaled copy.
            value = state.schedule.value_for(argument(args, kwargs, family.timestep_position, "timestep"))
        # Only reuse across steps (`recompute_every`) carries anything from one forward into the next.
        marker = family.generation_marker(args, kwargs) if state.config.recompute_every > 1 else None
        # The text input names the forward's branch of the step (two calls per step for a classifier-free guidance).
        text = None
        if state.config.recompute_every > 1 and not is_compiling():
            position = _text_position(model)
            text = kwargs.get("encoder_hidden_states") if position is None else None
            if position is not None:
                text = argument(args, kwargs, position, "encoder_hidden_states")
        timestep = family.timestep(args, kwargs)
        state.begin(grid[-2:], timestep, value, marker, frames, tail, text)
        state.shard = shard
        state.set_paying(paying)

    def _tokens_beyond_grid(self, args: tuple, kwargs: dict, grid_tokens: int) -> int:
        """Tokens of the model's token-sequence input (`(B, N, C)`) after the grid's; 0 for a latent input."""
        family = self.family
        x = argument(args, kwargs, family.input_position, family.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            return 0
        return max(int(x.shape[1]) - grid_tokens, 0)

    def _sequence_shards(self, model: torch.nn.Module) -> Shards | None:
        parallel = model._parallel_config if hasattr(model, "_parallel_config") else None
        if parallel is not self._parallel_seen:
            self._parallel_seen, self._shards = parallel, sequence_shards(model)
            self._parallel_config = parallel if self._shards is not None else None
        return self._shards

    def _local_grid(
        self, model: torch.nn.Module, grid: tuple[int, int], frames: int, shards: Shards, tail: int, lead: int = 0
    ) -> LocalGrid | None:
        """This rank's grid under context parallelism (`lead` tokens ahead of the grid's in the split sequence), or
        None (said once) where its tokens form none."""
        context = model._parallel_config.context_parallel_config
        uneven = uneven_split(context)
        window_frames = self.model_state.config.st
        shard = None if uneven or tail else local_grid((frames, *grid), shards, window_frames, lead)
        if shard is None:
            state = self.model_state
            if uneven:
                why = "an uneven split (ulysses_anything / ring_anything). Split evenly to merge"
            elif tail:
                why = (
                    f"the image's tokens and {tail} others after them (reference images), split as one sequence, so "
                    "a rank may hold no generated token. Run edits without context parallelism to merge"
                )
            elif lead:
                why = (
                    f"{lead} other tokens, then {frames}x{grid[0]}x{grid[1]} tokens, split as one sequence over "
                    f"{shards.count} ranks, so that a rank holds less than a row of them, or the sequence splits "
                    "unevenly. Choose a size that gives each rank a row of the video or more"
                )
            else:
                why = (
                    f"{frames}x{grid[0]}x{grid[1]} tokens that split into runs shorter than a row, or unevenly, over "
                    f"{shards.count} ranks. Choose a size that gives each rank a row of tokens or more"
                )
            report_skip(
                state.skips,
                Skip.SHARD,
                message=f"ToMe merges nothing in {type(model).__name__} under context parallelism: its blocks get "
                f"{why}. (Said once per model.)",
            )
        return shard

    def _device_type(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> str:
        x = argument(args, kwargs, self.family.input_position, self.family.input_name)
        if isinstance(x, torch.Tensor):  # `device` makes an object per call; the flags are plain reads
            return "cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type
        return next((p.device.type for p in model.parameters()), "cpu")

    def paying(self, grid: tuple[int, int], frames: int, device_type: str) -> tuple[int, ...]:
        """Each block's `pays_only` factor for this grid and device type (0: merges nothing), decided once."""
        key = (grid, frames, device_type)
        for known, factors in self.decisions:
            if known == key:
                return factors
        state = self.model_state
        config = state.config
        group = group_of(self.family.name)
        factors, verdicts = decide(config, group, self.shapes, grid, frames, device_type, state.max_downsample(config))
        self.decisions = (*self.decisions[-15:], (key, factors))
        if not is_compiling():
            _log_decision(type(self.model).__name__, config, grid, frames, device_type, verdicts)
        return factors

    def _warn_if_too_small(self, model: torch.nn.Module, grid: tuple[int, int], frames: int) -> None:
        config = self.model_state.config
        (h, w), too_small = grid, []
        if h // config.sy == 0 or w // config.sx == 0:
            too_small.append(f"its {h}x{w} token grid has no whole {config.sy}x{config.sx} (sy x sx) window")
        if config.st > 1 and frames > 1 and frames // config.st == 0:  # one frame merges as an image (st=1)
            too_small.append(f"its {frames} frame(s) make no window of st={config.st} frames")
        if too_small and config.ratio > 0:
            self.warned_small_grid = True
            # Through the one reporter (warned once per model and cause; an error under `strict_skips`).
            reason = Skip.SMALL_GRID if h // config.sy == 0 or w // config.sx == 0 else Skip.FEW_FRAMES
            message = (
                f"ToMe merges nothing in this {type(model).__name__} forward: {'; '.join(too_small)}. Smaller "
                "windows (sx, sy, st) merge such inputs. (Said once per model.)"
            )
            report_skip(self.model_state.skips, reason, message=message)
            self.model_state.skips.reported.update((Skip.SMALL_GRID, Skip.FEW_FRAMES) if len(too_small) > 1 else ())

    def inner_of(self, attn: torch.nn.Module, processor: Any) -> Any:
        """What `processor`, a ToMe processor on `attn`, runs: its inner one, or the one `attn` is built with."""
        return processor.built_inner(attn, self.family.built_processor(self.model, attn))

    def block_of(self, module: torch.nn.Module) -> BlockState | None:
        for block_module, block in zip(self.block_modules, self.blocks, strict=True):
            if block_module is module:
                return block
        return None

    def holds_processor(self) -> bool:
        """Whether some attention module still holds a ToMe processor (identity and type checks only)."""
        kind = self.processor_type
        # Stops at the first hit: while ToMe is on, that is the first module.
        for attn in self.watched:
            if isinstance(getattr(attn, "processor", None), kind):
                return True
        return False

    def reset(self) -> None:
        """Forget this thread's generation: token grid, step count, kept merges, block inputs, timesteps."""
        state = self.model_state
        state.reset()
        for block in state.blocks:
            block.reset()

    def remove(self) -> None:
        """Take away every hook, slot and wrapped method ToMe added to its model."""
        if self.keeper is not None:
            self.keeper.uninstall()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for attn in self.slotted:
            if SLOT_ATTR in attn.__dict__:
                delattr(attn, SLOT_ATTR)
        self.slotted.clear()
        self.reset()
        release_buffers()  # the merges' zero tensors (device memory); another model's merges make theirs again

    def stand_down(self, model: torch.nn.Module) -> None:
        """No ToMe processor is left in `model`: take everything away (or, while compiling, merge nothing), and say
        so once: something replaced every processor ToMe was on."""
        if is_compiling():  # hooks cannot be taken off inside a traced graph
            self.reset()
            return
        log = self.model_state.skips
        self.remove()
        name = type(model).__name__
        report_skip(
            log,
            Skip.REPLACED,
            message=f"ToMe stood down on {name}: every attention processor ToMe was on has been replaced "
            "(set_attn_processor, or attn.processor = ...) since it was applied, so nothing merges from this forward "
            "on. To keep ToMe on through processor swaps, turn it on with pipe.enable_tome() (after "
            "tome_processors.patch_pipelines()), or apply it after the processors are set; to turn it off on "
            "purpose, remove_tome says nothing. (Said once.)",
        )


def _begin_mid_forward(context: ModelHooks) -> None:
    """Start this thread's forward of `context.model` from the calls on its stack: the thread's first call into
    the model's hooks came from a block or an attention, so the model's pre-hook never ran for it (another thread
    attached the context while this one's forward was running, `set_attn_processor(ToMeProcessor())`)."""
    if is_compiling():  # no stack to read inside a traced graph: this forward merges nothing, the next does
        return
    calls = module_calls(sys._getframe(1))
    model = next(((args, kwargs) for module, args, kwargs in calls if unwrap_module(module) is context.model), None)
    if model is None:  # a block called on its own: no forward of the model to start
        return
    context.begin(context.model, *model)
    for module, args, kwargs in calls:
        for index, block in enumerate(context.block_modules):
            if module is block:
                enter_block(context.states.block(index), args, kwargs, _span_site(context.sites[index]))


def _text_position(model: torch.nn.Module) -> int | None:
    """Where `model.forward` takes `encoder_hidden_states` when passed by position, or None where it takes none."""
    return _forward_parameter(type(model), "encoder_hidden_states")


@functools.cache
def _forward_parameter(model_type: type, name: str) -> int | None:
    try:
        names = list(inspect.signature(model_type.forward).parameters)[1:]  # after `self`
    except (TypeError, ValueError):
        return None
    return names.index(name) if name in names else None


class _ModelPreHook:
    """The model's forward pre-hook; holds the context, so `context_of` finds it among the model's hooks.

    Hooks are objects, not closures: `copy.deepcopy` copies them with the model (their references to the
    model's modules become the copy's), and `pickle` / `torch.save` can store them.
    """

    def __init__(self, context: ModelHooks) -> None:
        self.context = context

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        context = self.context
        if not context.holds_processor():
            context.stand_down(module)
            return
        if not is_compiling():  # a tool may replace the attention forwards between calls (T-GATE: at each call)
            warn_replaced_forwards(module, context.slotted, stacklevel=3)
        context.begin(module, args, kwargs)


class _BlockHook:
    """A hook of one block: it finds the block's state of the thread it runs in (`BlockSlot`)."""

    def __init__(self, slot: BlockSlot) -> None:
        self.slot = slot

    @property
    def block_state(self) -> BlockState:
        return self.slot.state


class _BlockPreHook(_BlockHook):
    def __init__(self, slot: BlockSlot, site: BlockSite | None) -> None:
        super().__init__(slot)
        self.site = site  # only where the block's input holds other tokens than the grid's

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        enter_block(self.block_state, args, kwargs, self.site)


class _BlockPostHook(_BlockHook):
    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        block_state = self.block_state
        if block_state.factor != 0:  # a block that merges nothing this forward holds nothing
            block_state.reset()


class _FeedForwardPreHook(_BlockHook):
    """Merges the feed-forward's input with its block's merge (`merge_mlp`); the feed-forward is no attention module."""

    def __init__(self, slot: BlockSlot, config: ToMeConfig) -> None:
        super().__init__(slot)
        self.config = config

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        block_state = self.block_state
        block_state.ff_merge = None
        hidden_states = argument(args, kwargs, 0, "hidden_states")
        merge = block_state.merge_for(self.config, text=None)  # the attention's merge, whatever its positions
        if merge is None or not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 3:
            return None
        if (merge.batch, merge.num_tokens) != tuple(hidden_states.shape[:2]):
            merge = _chunk_merge(block_state, merge, hidden_states)
            if merge is None:
                return None
        block_state.ff_merge = merge
        merged = merge.merge(hidden_states)
        if args:
            return (merged, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": merged}


def _chunk_merge(block_state: BlockState, merge: Any, hidden_states: torch.Tensor) -> Any:
    """The merge of one chunk of a chunked feed-forward (`enable_forward_chunking`), or None.

    Chunks over the batch (diffusers' default, `dim=0`) come in order, each a few whole samples: each gets the
    merge of its samples. Chunks over the tokens (`dim=1`) hold a part of each sample's tokens, which no merge
    covers: they are not merged, and a warning says so once per model.
    """
    batch, tokens = int(hidden_states.shape[0]), int(hidden_states.shape[1])
    if tokens == merge.num_tokens and merge.batch % batch == 0 and not (merge.text_rows or merge.tail):
        start = block_state.ff_chunk_start
        block_state.ff_chunk_start = (start + batch) % merge.batch
        return merge.samples(start, start + batch)
    model = block_state.model
    if tokens < merge.num_tokens and merge.num_tokens % tokens == 0 and not model.warned_chunks and not is_compiling():
        model.warned_chunks = True
        warnings.warn(
            "ToMe's merge_mlp=True merges nothing in a feed-forward chunked over the tokens "
            "(enable_forward_chunking(dim=1)): chunk over the batch (dim=0, the default) to merge it. (Said once.)",
            UserWarning,
            stacklevel=2,
        )
    return None


class _FeedForwardPostHook(_BlockHook):
    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        block_state = self.block_state
        merge, block_state.ff_merge = block_state.ff_merge, None
        if merge is None or not isinstance(output, torch.Tensor):  # output is None after an exception
            return None
        return merge.unmerge(output)


def context_of(model: torch.nn.Module) -> ModelHooks | None:
    """The `ModelHooks` installed on `model` (or on the module `torch.compile` wraps), or None."""
    hooks = getattr(unwrap_module(model), "_forward_pre_hooks", None) or {}
    return next((hook.context for hook in hooks.values() if isinstance(hook, _ModelPreHook)), None)


def install(plan: ToMePlan, processor_type: type) -> ModelHooks:
    """Install the merge context of `plan` on its model: a model pre-hook and hooks on every block of its plan.

    `processor_type` is the processor class that reads the slots: the context stands down at the
    first forward in which no attention module of the model holds one.
    """
    model, family, config = unwrap_module(plan.model), plan.family, plan.config
    sites = list(plan.sites)
    with one_walk(model, plan.walk if model is plan.model else None):
        state = ModelState(
            config=config,
            auto_downsample=family.auto_downsample(model),
            needs_row_token=family.needs_row_token,
            rotary=family.rotary,
            masks_text_only=family.masks_text_only,
            one_grid=_one_grid(model, sites),
            fixed_at_odd_batch=family.guidance_in_batch,
        )
        state.skips.model_name = type(model).__name__
        context = ModelHooks(model, state, plan, processor_type)
        context.watched = list(plan.attentions)
        names = {module: name for name, module in named_modules_of(model)}  # for what a skipped attention says
        context.shapes = site_shapes(model, family, sites)
    context.keeper = ProcessorKeeper(model, context.watched, processor_type, config, context.inner_of)
    context.handles.append(model.register_forward_pre_hook(_ModelPreHook(context), with_kwargs=True))
    for index, site in enumerate(sites):
        context.block_modules.append(site.module)
        _install_block(context, site, index, config, names)
    context.keeper.install()
    context.reset()  # makes the installing thread's state here, not in a traced first call
    logger.debug("ToMe hooks on %s (%s): %d blocks", type(model).__name__, family.name, len(context.block_modules))
    return context


def _log_decision(
    name: str, config: ToMeConfig, grid: tuple[int, int], frames: int, device_type: str, verdicts: dict
) -> None:
    """Say once, at INFO, where `pays_only` merges less than `config` selects on this grid and device type."""

    def full(level: int) -> int:  # what the config selects at a level
        return config.kv_factor_at(level) if config.mode == "downsample_kv" else 1

    if all(verdict.factor == full(level) for (level, _), verdict in verdicts.items()):
        return
    size = f"{frames}x{grid[0]}x{grid[1]}" if frames > 1 else f"{grid[0]}x{grid[1]}"
    parts = []
    for (level, width), verdict in sorted(verdicts.items()):
        if verdict.factor == 0:
            what = "merges nothing"
        elif config.mode == "downsample_kv":
            what = f"pools {verdict.factor}x{verdict.factor}"
        else:
            what = "merges"
        parts.append(f"level {level} (width {width}) {what}: {verdict.why}")
    logger.info("ToMe on %s, %s token grid on %s (pays_only): %s", name, size, device_type, "; ".join(parts))


def _one_grid(model: torch.nn.Module, sites: list[BlockSite]) -> bool:
    """Whether every block of `model` (its `sites`) merges the latent's token grid alone (`ModelState.one_grid`)."""
    layouts = {attention.layout for site in sites for attention in site.attentions}
    return not attention_levels(model) and layouts <= {Layout.IMAGE, Layout.ROTARY}


def enter_block(block_state: BlockState, args: tuple, kwargs: dict, site: BlockSite | None = None) -> None:
    """Start a block's forward: its raw input (image tokens, before norm1) is tomesd's similarity metric.

    Where the block's input holds other tokens too (`site.span`), the metric is the grid's tokens of it (before
    the model's tail, `ModelState.tail`, in a trailing span).
    """
    if block_state.factor == 0:  # `pays_only`: merging does not pay in this block (its post-hook left it clear)
        return
    block_state.reset()
    hidden_states = argument(args, kwargs, 0, "hidden_states")
    model = block_state.model
    if not isinstance(hidden_states, torch.Tensor):
        return  # nothing to merge from
    shard = model.shard
    if shard is not None and hidden_states.ndim == 3 and hidden_states.shape[1] == shard.whole_tokens:
        # Context parallelism that splits at this block's input (Wan's and Qwen-Image's first block): its pre-hook
        # runs before diffusers' split, so the metric is this rank's run of the whole input.
        hidden_states = hidden_states[:, shard.start : shard.start + shard.run]
    latent_hw = model.latent_hw
    if site is not None and latent_hw is not None:
        grid_tokens = model.frames * latent_hw[0] * latent_hw[1] + (shard.extra if shard is not None else 0)
        hidden_states = site.metric(hidden_states, grid_tokens, model.tail, sharded=shard is not None)
    block_state.metric = hidden_states
    block_state.prepare()


def _span_site(site: BlockSite) -> BlockSite | None:
    """`site` where its block's input holds other tokens than the grid's (what its pre-hook cuts), else None."""
    return site if site.span is not Span.WHOLE else None


def _install_block(
    context: ModelHooks, site: BlockSite, index: int, config: ToMeConfig, names: dict | None = None
) -> None:
    block, slot = site.module, context.states.slots[index]
    pre = _BlockPreHook(slot, _span_site(site))
    context.handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
    post = _BlockPostHook(slot)
    context.handles.append(block.register_forward_hook(post, with_kwargs=True, always_call=True))

    for attention in site.attentions:
        built_with = attention.built_with or context.family.built_with or class_default_processor(attention.module)
        attention_slot = AttentionSlot(
            slot,
            attention.is_cross,
            attention.layout,
            built_with,
            mask_at=attention.mask_at,
            rotary_at=attention.rotary_at,
            name=(names or {}).get(attention.module, type(attention.module).__name__),
        )
        setattr(attention.module, SLOT_ATTR, attention_slot)
        context.slotted.append(attention.module)

    if config.merge_mlp and site.feed_forward is not None:
        ff = site.feed_forward
        pre = _FeedForwardPreHook(slot, config)
        context.handles.append(ff.register_forward_pre_hook(pre, with_kwargs=True))
        context.handles.append(ff.register_forward_hook(_FeedForwardPostHook(slot), with_kwargs=True, always_call=True))


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


def set_token_grid(model: torch.nn.Module, grid: tuple[int, int] | None) -> None:
    """Tell ToMe on a compiled FLUX-like model (FLUX.1, FLUX.2, Chroma) the token grid of the coming forwards.

    These models get their grid only as the values of `img_ids`, which a compiled graph cannot read: without
    this, a compiled forward reads them outside the graph (one graph break, so `fullgraph=True` fails).
    Pipelines with ToMe applied (`apply_tome(pipe)`, `pipe.enable_tome()`) note the grid themselves in every
    call. The grid holds for forwards with `h * w` image tokens until the next generation (`new_generation`,
    a pipeline call's end); eager forwards read `img_ids` as always.

    Args:
        model: a model with ToMe applied.
        grid: `(h, w)` image tokens (the latent's size over 2 on FLUX.1), or None to forget it.

    Example:
        >>> tome_processors.set_token_grid(transformer, (64, 48))  # 1024 x 768 px on FLUX.1  # doctest: +SKIP
        >>> compiled = torch.compile(transformer, fullgraph=True)  # doctest: +SKIP
    """
    context = context_of(model)
    if context is None:
        raise ValueError(f"Expected a model with ToMe applied, but got {type(model).__name__} without it.")
    if grid is not None:
        if not (isinstance(grid, tuple) and len(grid) == 2 and all(isinstance(v, int) and v > 0 for v in grid)):
            raise ValueError(f"Expected grid to be (h, w), two positive ints, or None, but got {grid!r}.")
    context.grid_hint = grid


class _PipelineWatch:
    """One pipeline method wrapped on the instance by `watch_schedule`: `before` / `after` it, or `around` it."""

    def __init__(self, method: Any, own: Any, before: Any = None, after: Any = None, around: Any = None) -> None:
        self.method = method
        self.own = own  # an instance attribute there before us, put back by `unwatch_schedule`
        self.before = before
        self.after = after
        self.around = around
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before()
        if self.around is not None:
            with self.around():
                result = self.method(*args, **kwargs)
        else:
            result = self.method(*args, **kwargs)
        if self.after is not None:
            self.after(result)
        return result


#: Pipeline methods that replace or read the processors of its models by class without going through a
#: model method (the xFormers switch walks every submodule itself after the model's own method returned).
_PROCESSOR_METHODS = ("unload_ip_adapter", "set_ip_adapter_scale", "set_use_memory_efficient_attention_xformers")


def watch_schedule(pipeline: Any, models: Sequence[torch.nn.Module]) -> None:
    """Follow the generations of `pipeline` for ToMe on `models`, through methods every pipeline calls.

    - `progress_bar(...)`, which every diffusers pipeline opens its denoising loop with, after
      `scheduler.set_timesteps` (and img2img's `set_begin_index`): a new generation starts there, however
      the last call ended (a callback or `KeyboardInterrupt` that stopped it midway); for the models whose
      configuration has `ratio_start`, `pipeline.scheduler.timesteps` are copied to the host, once per
      generation and outside any forward.
    - `prepare_latents(...)`: the Flux-like pipelines return the generation's `img_ids` from it. Their grid
      is read there, on the host, once per generation, for a compiled model (a traced graph cannot read it).
    - `maybe_free_model_hooks()`, which every `__call__` ends with: the state is reset (kept merges go).
    - the pipeline's own processor switches (`_PROCESSOR_METHODS`) run with the models' plain processors in
      place, and ToMe wraps what they set afterwards (`keeper.py`).

    Watching again replaces an earlier watch; without a model with ToMe nothing is wrapped.
    """
    unwatch_schedule(pipeline)
    models = list(models)
    if all(context_of(model) is None for model in models):
        return
    watches: dict[str, dict[str, Any]] = {
        "progress_bar": dict(before=functools.partial(_start_generation, pipeline, models)),
        "prepare_latents": dict(after=functools.partial(_note_grid, models)),
        "maybe_free_model_hooks": dict(after=functools.partial(_end_generation, models)),
    }
    watches.update({name: dict(around=functools.partial(_models_unwrapped, models)) for name in _PROCESSOR_METHODS})
    for name, hooks in watches.items():
        original = getattr(pipeline, name, None)
        if callable(original):
            object.__setattr__(pipeline, name, _PipelineWatch(original, pipeline.__dict__.get(name), **hooks))


def unwatch_schedule(pipeline: Any) -> None:
    """Undo `watch_schedule` (nothing when the pipeline is not watched)."""
    for name, wrapper in list(getattr(pipeline, "__dict__", {}).items()):
        if isinstance(wrapper, _PipelineWatch):
            if wrapper.own is None:
                del pipeline.__dict__[name]
            else:
                pipeline.__dict__[name] = wrapper.own


def _models_unwrapped(models: list[torch.nn.Module]) -> Any:
    contexts = [context_of(model) for model in models]
    return all_unwrapped([c.keeper for c in contexts if c is not None and c.keeper is not None and c.keeper.installed])


def _end_generation(models: list[torch.nn.Module], result: Any = None) -> None:
    for context in map(context_of, models):
        if context is not None:
            context.reset()


def _note_grid(models: list[torch.nn.Module], result: Any) -> None:
    contexts = [c for c in map(context_of, models) if c is not None]
    # The first ids in the result are the generated image's (FLUX.1 Kontext returns its reference image's after).
    for context in contexts:
        for tensor in result if isinstance(result, tuple) else (result,):
            grid = context.family.grid_of_ids(tensor)
            if grid is not None:
                context.grid_hint = grid
                break


def _start_generation(pipeline: Any, models: list[torch.nn.Module]) -> None:
    contexts = [c for c in map(context_of, models) if c is not None]
    for context in contexts:
        hint = context.grid_hint  # noted by this call's `prepare_latents`, which runs before the loop
        context.reset()
        context.grid_hint = hint
    contexts = [c for c in contexts if c.model_state.config.ratio_start is not None]
    if not contexts:
        return
    timesteps = getattr(getattr(pipeline, "scheduler", None), "timesteps", None)
    schedule = None
    if isinstance(timesteps, torch.Tensor) and timesteps.ndim == 1:
        schedule = HostSchedule(timesteps, pipeline)  # one copy for every model of the pipeline
    for context in contexts:
        context.schedule = schedule
