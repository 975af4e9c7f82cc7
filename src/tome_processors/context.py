"""Per-forward state shared by the hooks and the processors of one model.

`ModelState` holds what the model's forward tells us (latent size, timestep, step count) and the
merges kept for reuse; `BlockState` holds, for one transformer block and one forward, the raw block
input and the merges computed from it; `HostSchedule` is a generation's timesteps on the host (for
`ratio_start`); `AttentionSlot` tells a processor which block it sits in and whether it is self- or
cross-attention. Hooks fill and clear them; processors only read them.

A model serves several threads at once (a server's concurrent requests on one model): `ForwardStates` gives each
thread a `ModelState` and `BlockState`s of its own, so what one forward computes stays with the thread that runs
it. What belongs to the model is shared: the configuration, the caches made once per grid and device, and the
causes of skips already said.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ._similarity import is_compiling
from .config import ToMeConfig
from .families import Layout, Rotary
from .merge import (
    GridLayout,
    Partition,
    TokenMerge,
    cached,
    fold_frames,
    level_downsample,
    match,
    window_choice,
    window_mix,
)
from .skips import Skip, SkipLog, report_skip

_MAX_KEPT_MERGES = 256  # bound on merges kept for reuse across blocks/steps


class Grid(NamedTuple):
    """A block's token grid: `h x w` tokens at `downsample` times below the latent, in each of `frames` frames, then
    `extra` tokens that start one more frame (one more row of a single frame): a context-parallel rank's run that
    ends inside a frame or row (`parallel.LocalGrid.extra`), merged as edges (`GridLayout.extra`)."""

    h: int
    w: int
    downsample: int
    frames: int = 1
    extra: int = 0

    @property
    def tokens(self) -> int:
        return self.frames * self.h * self.w + self.extra


@dataclass
class _KeptMerge:
    merge: TokenMerge
    step: int


#: Branches (calls of one step with another text input) counted at once; the oldest is forgotten beyond.
_MAX_BRANCHES = 8


@dataclass
class _Branch:
    """The calls of a generation with one text input (a weak reference; None where the call has none).

    Pipelines that run classifier-free guidance as two model calls (Qwen-Image, Chroma, Wan) pass the prompt's
    embeddings in one and the negative prompt's in the other, the same two tensors at every step: each branch
    counts its own steps and keeps its own merges, so neither call reuses the other's.
    """

    text: weakref.ref | None
    key: int
    step: int = 0
    last_timestep: object = None
    marker: torch.Tensor | None = None  # its last generation marker (`Family.generation_marker`), held


@dataclass
class ModelState:
    """What one forward of the model tells the blocks, and what is cached for them.

    Attributes:
        config: the configuration the hooks were installed with.
        auto_downsample: what `max_downsample="auto"` means on this model.
        needs_row_token: whether merges record `TokenMerge.row_token` (Flux's rotary embeddings).
        rotary: how the family's processors receive rotary positions (`families.Rotary`), or None.
        masks_text_only: whether the family's attention masks mask text tokens only (every image token
            is a valid key), so a mask can be cut down to the merged sequence (Chroma, Z-Image).
        one_grid: whether every merged block sees the latent's token grid alone (no downsampled levels, no
            text tokens beside it): Wan, LTX-Video, PixArt. Then each block's pre-hook makes the forward's
            partitions (`BlockState.prepare`).
        fixed_at_odd_batch: tomesd's rule: random destinations (`use_rand`) are turned off at an odd batch,
            which cannot hold a classifier-free guidance's two halves (`Family.guidance_in_batch`).
        latent_hw: `(H, W)` of the model's token grid in the current (or last) forward.
        frames: frames of that grid (a video model's; 1 for an image).
        tail: tokens after the grid's in the model's image-token input, never merged (`Family.trailing_tokens`:
            FLUX.2's reference images); 0 elsewhere.
        timestep: the current forward's timestep as given (a tensor stays on its device).
        timestep_value: the timestep as a number, only for `ratio_start`: from the generation's
            `HostSchedule` where it has this forward's timestep, else read on the host.
        step: denoising steps since the generation started, for `recompute_every`, counted per branch: the
            forwards with one text input (`encoder_hidden_states`, the same tensor object) form a branch, and a
            forward with another timestep object (or number) than its branch's last is the branch's next step.
            A classifier-free guidance run as two calls per step (the prompt's and the negative prompt's
            embeddings) so counts denoising steps, however each call makes its timestep (Qwen-Image and Chroma
            pass a new `timestep / 1000` to each); nothing is read from the device. A generation
            starts at `reset()` and at a forward whose generation marker (`Family.generation_marker`: the
            schedule a pipeline's timestep views, FLUX.1's and Chroma's `img_ids`, FLUX.2's `txt_ids`) is another
            than its branch's last one; a branch whose text tensor is gone is forgotten with its merges.
        num_blocks: blocks registered (`BlockState`), for drawing every block's destinations at once.
        kept: merges kept for `recompute_every`.
    """

    config: ToMeConfig
    auto_downsample: int = 1
    needs_row_token: bool = False
    rotary: Rotary | None = None
    masks_text_only: bool = False
    one_grid: bool = False
    fixed_at_odd_batch: bool = True
    warned_chunks: bool = False  # `merge_mlp` said once that a feed-forward chunked over the tokens is not merged
    latent_hw: tuple[int, int] | None = None
    frames: int = 1
    tail: int = 0
    timestep: object = None
    timestep_value: float | None = None
    step: int = 0
    num_blocks: int = 0
    kept: dict[tuple, _KeptMerge] = field(default_factory=dict)
    # Per forward: the keys of each grid's partitions (handed to the blocks, `BlockState.planned`), and the
    # merges shared within a level. Tuples
    # that are replaced, not mutated: torch.compile breaks the graph at diffusers' signature lookup
    # after a dict mutation.
    _plans: tuple = ()
    _stacks: tuple = ()
    _shared: tuple = ()
    # The forward's rotary tables (Wan's `(cos, sin)`, as a tuple of those tensors: `rotary_attention`'s key) and
    # both as one `(N, 1, 2D)` table, for one gather per merge.
    rotary_tables: tuple = ()
    # Per grid and device, built once (bounded): `GridLayout`s, the per-block hash values of the random
    # choice, and the fixed partitions.
    _layouts: dict[tuple, GridLayout] = field(default_factory=dict)
    _mixes: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _fixed_partitions: dict[tuple, Partition] = field(default_factory=dict)
    # What tells a new step (`recompute_every`): the last timestep (a weak reference to a tensor, or a
    # number) and whether the last forward ran in inference mode.
    _last_timestep: object = None
    _inference: bool | None = None
    # The current forward's branch (its key in `kept`), and the generation's branches (`_Branch`).
    branch: int = 0
    _branches: list[_Branch] = field(default_factory=list, repr=False, compare=False)
    # The current generation's marker (`Family.generation_marker`), held so that no later tensor can take
    # its storage's address while it is compared with.
    _generation: torch.Tensor | None = None
    # Every block's state (each `BlockState` adds itself), to hand each block its own of a forward's partitions.
    blocks: list[BlockState] = field(default_factory=list, repr=False, compare=False)
    #: With `pays_only`: each block's factor for this forward's grid and device type (0: merges nothing; K/V
    #: pooling: its window side), decided once per grid by the model's pre-hook (pays.py); None without.
    paying: tuple[int, ...] | None = None
    #: Under context parallelism, the grid of this rank's tokens (`parallel.LocalGrid`; `latent_hw` and `frames`
    #: are its); None without.
    shard: Any = None
    #: The model's context-parallel config (diffusers' `ParallelConfig`), for the processors ToMe builds; else None.
    parallel_config: Any = None
    #: Why the model's pre-hook found this whole forward unmergeable, where it said so itself (a context-parallel
    #: shard with no whole row): what its attentions report instead of their own causes, so one warning says it.
    forward_skip: Skip | None = None
    #: The causes of unmerged attention already reported for this model (skips.py); kept across generations.
    skips: SkipLog = field(default_factory=SkipLog, repr=False, compare=False)
    #: This generation's timesteps on the host, for `ratio_start` (`set_timestep_schedule`, a pipeline's loop).
    schedule: HostSchedule | None = field(default=None, repr=False, compare=False)
    #: The generation's token grid as its pipeline made it (`prepare_latents`, `set_token_grid`), for a compiled
    #: forward.
    grid_hint: tuple[int, int] | None = None

    def for_thread(self, num_blocks: int) -> ModelState:
        """A state for one more thread: this one's configuration, its caches per grid and device and its skip log
        shared, no forward begun; with `num_blocks` `BlockState`s."""
        # Every field given, none made by a factory of its own: a compiled first call traces this.
        state = ModelState(
            self.config,
            self.auto_downsample,
            self.needs_row_token,
            self.rotary,
            self.masks_text_only,
            self.one_grid,
            self.fixed_at_odd_batch,
            _layouts=self._layouts,
            _mixes=self._mixes,
            _fixed_partitions=self._fixed_partitions,
            skips=self.skips,
        )
        for index in range(num_blocks):
            BlockState(state, index)
        return state

    def __getstate__(self) -> dict:
        # A copy (`copy.deepcopy`, `pickle`) starts with no generation and empty caches: they hold the
        # last forward's tensors and weak references, and fill again at the copy's first forward.
        fresh = ModelState(
            self.config,
            self.auto_downsample,
            self.needs_row_token,
            self.rotary,
            self.masks_text_only,
            self.one_grid,
            self.fixed_at_odd_batch,
        )
        fresh.num_blocks = self.num_blocks
        fresh.skips = SkipLog(self.skips.model_name)
        return dict(vars(fresh))

    def reset(self) -> None:
        """Forget the current generation: the next forward is its first step."""
        self.schedule = None
        self.grid_hint = None
        self.latent_hw = None
        self.frames = 1
        self.tail = 0
        self.timestep = None
        self.timestep_value = None
        self.step = 0
        self._last_timestep = None
        self._forget_branches()
        self._generation = None
        self.set_paying(None)
        self.kept.clear()
        self._forget_forward()

    def begin(
        self,
        latent_hw: tuple[int, int],
        timestep: object,
        timestep_value: float | None = None,
        marker: torch.Tensor | None = None,
        frames: int = 1,
        tail: int = 0,
        text: object = None,
    ) -> None:
        """Record the token grid (a UNet's latent, a transformer's patch grid; `frames` of it in a video) and
        timestep of a forward, and the `tail` of tokens after the grid's (`ModelState.tail`).

        Nothing is read back from the device: the random choice keys on the timestep tensor itself, and
        `ratio_start` takes `timestep_value` (the timestep as found in a `HostSchedule`), reading the
        timestep on the host only where that is None. `marker` (`Family.generation_marker`, or None where
        the call tells nothing) starts a new generation where its storage is another than the last one's.
        `text` (the call's text input, only with `recompute_every > 1`) names the forward's branch (`step`).
        """
        branch = self._enter_branch(text, marker) if self.config.recompute_every > 1 else None
        # Another image size: merges kept for reuse no longer fit. (`kept` first: nothing is kept in a compiled
        # forward, and the last forward's size read there would be a guard that the next forward fails.)
        if self.kept and self.latent_hw is not None and (latent_hw, frames) != (self.latent_hw, self.frames):
            self.kept.clear()
        self.latent_hw = latent_hw
        self.frames = frames
        self.tail = tail
        self.timestep = timestep
        self._forget_forward()
        if branch is not None:  # host counting: reuse across steps is for eager runs
            self._count_step(timestep, branch)
        if self.config.ratio_start is not None:
            self.timestep_value = timestep_value if timestep_value is not None else _timestep_value(timestep)

    def begin_idle(self, latent_hw: tuple[int, int], frames: int, paying: tuple[int, ...]) -> None:
        """Start a forward in which `pays_only` merges in no block (`paying` all 0): record its grid and hand every
        block its 0; the last merging forward's tensors are let go once, when the verdict changes."""
        if paying is not self.paying:
            self.kept.clear()
            self._forget_forward()
            self.timestep = None
        self.latent_hw = latent_hw
        self.frames = frames
        self.set_paying(paying)

    def set_paying(self, paying: tuple[int, ...] | None) -> None:
        """Hand each block its `pays_only` factor (`BlockState.factor`), where the decision is another than the last.

        Each block reads its own attribute, not the tuple at its index: a compiled block (regional compilation)
        then guards on its own value, so blocks with one verdict share a graph. A new verdict also clears every
        block: a block that merges nothing skips its hooks' work, so it must hold nothing from before (a block
        whose post-hook never ran, attached while it was running, say).
        """
        if paying is not self.paying:
            for block in self.blocks:
                block.reset()
                block.factor = paying[block.index] if paying is not None and block.index < len(paying) else None
        self.paying = paying

    def _forget_forward(self) -> None:
        """Let go of what the last forward made for its blocks: plans, stacked and shared merges, rotary tables."""
        self._forget_plans()
        self._stacks = ()
        self._shared = ()
        self.rotary_tables = ()

    def _forget_plans(self) -> None:
        # Every block's handed-over partitions too: written here before a compiled graph reads any, so none
        # holds a guard on the last forward's.
        self._plans = ()
        for block in self.blocks:
            block.planned = ()

    def _forget_branches(self) -> None:
        self._branches = []
        self.branch = 0

    def _drop_branches(self, dropped: list[_Branch]) -> None:
        """Forget `dropped` branches and the merges they kept."""
        if not dropped:
            return
        gone = {branch.key for branch in dropped}
        self._branches = [branch for branch in self._branches if branch.key not in gone]
        self.kept = {key: kept for key, kept in self.kept.items() if key[2] not in gone}  # key[2]: the branch

    def _enter_branch(self, text: object, marker: torch.Tensor | None) -> _Branch:
        """The branch of a forward with text input `text` and generation marker `marker` (identity checks only).

        A branch whose marker's storage is another than its last one's starts a new generation: every branch and
        kept merge is forgotten. Branches whose text tensor is gone (the last call's prompt embeddings) are
        forgotten with their merges. Storage addresses are host metadata (no device read); each branch holds its
        last marker, so that no new tensor can have its address.
        """
        text = text if isinstance(text, torch.Tensor) else None
        self._drop_branches([b for b in self._branches if b.text is not None and b.text() is None])
        branch = next((b for b in self._branches if (b.text() if b.text is not None else None) is text), None)
        if branch is not None and marker is not None and branch.marker is not None:
            if branch.marker.untyped_storage().data_ptr() != marker.untyped_storage().data_ptr():
                self.kept.clear()  # a new generation
                self._forget_branches()
                branch = None
        if branch is None:
            if len(self._branches) >= _MAX_BRANCHES:
                self._drop_branches(self._branches[:1])
            used = {b.key for b in self._branches}
            key = next(k for k in range(len(used) + 1) if k not in used)  # the first branch of a generation is 0
            branch = _Branch(weakref.ref(text) if text is not None else None, key)
            self._branches = [*self._branches, branch]
        if marker is not None:
            branch.marker = marker
            self._generation = marker
        return branch

    def _count_step(self, timestep: object, branch: _Branch) -> None:
        last = branch.last_timestep
        if isinstance(timestep, torch.Tensor):
            same = isinstance(last, weakref.ref) and last() is timestep
            branch.last_timestep = weakref.ref(timestep)
        else:
            same = last is not None and not isinstance(last, weakref.ref) and last == timestep
            branch.last_timestep = timestep
        if last is not None and not same:
            branch.step += 1
        self.step, self.branch, self._last_timestep = branch.step, branch.key, branch.last_timestep
        inference = torch.is_inference_mode_enabled()
        if inference != self._inference:  # merges made in inference mode cannot be reused with autograd on
            self.kept.clear()
            self._inference = inference

    def max_downsample(self, config: ToMeConfig) -> int:
        return self.auto_downsample if config.max_downsample == "auto" else int(config.max_downsample)

    def layout(self, grid: Grid, config: ToMeConfig, device: torch.device) -> GridLayout:
        """The layout of `grid` (its frames, with windows of `config.st` frames; or one frame of it)."""
        st = config.st if grid.frames > 1 else 1
        key = (grid.h, grid.w, config.sx, config.sy, device, grid.frames, st, grid.extra)
        return cached(
            self._layouts,
            key,
            lambda: GridLayout.build(grid.h, grid.w, config.sx, config.sy, device, grid.frames, st, grid.extra),
        )

    def partitions(
        self,
        config: ToMeConfig,
        grid: Grid,
        batch: int,
        device: torch.device,
        text: int = 0,
        text_rows: int = 0,
        samples: int | None = None,
    ) -> int:
        """Where this forward's partitions of `grid` are in every block's `BlockState.planned` (made the first time).

        Each block gets its own partition (one per block, or one for all), found at the same place in every
        block: a block reads no number of its own to find it, so one compiled block serves all of them
        (regional compilation, `compile_repeated_blocks`; a number read in a compiled block is a guard).

        `text` / `text_rows`: see `GridLayout.with_text` (Flux's blocks: the text ahead of the image tokens).
        `samples`: the model's batch where `batch` counts frames (a video merged frame by frame).
        """
        samples = batch if samples is None else samples
        key = (config, grid, batch, device, text, text_rows, samples)
        for place, plan_key in enumerate(self._plans):
            if plan_key == key:
                return place
        layout = self.layout(grid, config, device)
        lead = self.needs_row_token
        # An odd batch cannot hold matching prompted/unprompted halves: no randomness (as tomesd), on the families
        # whose pipelines batch the two halves of a classifier-free guidance (`fixed_at_odd_batch`).
        if config.use_rand and (samples % 2 == 0 or not self.fixed_at_odd_batch):
            stack = self._stack(config, layout, batch, device)
            if text or text_rows or lead:  # once per forward for every block, not in each block
                stack = layout.with_text(stack, batch, text, text_rows, lead)
            plan = stack.unbind()
        else:
            plan = [self._fixed(layout, batch, text, text_rows)]
        place = len(self._plans)
        for block in self.blocks:  # after this forward's earlier plans
            block.planned = (*block.planned, plan[block.index] if len(plan) > 1 else plan[0])
        self._plans = (*self._plans, key)
        return place

    def _stack(self, config: ToMeConfig, layout: GridLayout, batch: int, device: torch.device) -> Partition:
        # Every block's partition of this forward, drawn at once; kept for the forward's other text layouts.
        key = (config, layout.h, layout.w, layout.frames, batch, device)
        for stack_key, stack in self._stacks:
            if stack_key == key:
                return stack
        choice = window_choice(self._mix(config, layout, device), self._step_key(), layout.places)
        stack = layout.partitions(choice, batch)
        self._stacks = (*self._stacks, (key, stack))
        return stack

    def _fixed(self, layout: GridLayout, batch: int, text: int, text_rows: int) -> Partition:
        key = (layout.h, layout.w, layout.sx, layout.sy, layout.frames, layout.st, layout.origins.device, batch)
        key = (*key, text, text_rows)

        def make() -> Partition:
            partition = layout.fixed(batch)
            if text or text_rows or self.needs_row_token:
                partition = layout.with_text(partition, batch, text, text_rows, self.needs_row_token)
            return partition

        return cached(self._fixed_partitions, key, make)

    def _mix(self, config: ToMeConfig, layout: GridLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (config.seed, max(self.num_blocks, 1), layout.windows, device)
        return cached(self._mixes, key, lambda: window_mix(key[1], layout.windows, config.seed, device))

    def _step_key(self) -> torch.Tensor | int:
        timestep = self.timestep
        if isinstance(timestep, torch.Tensor):
            # Sixteenths of a step tell fractional (Karras/Euler) timesteps apart; computed on the device.
            first = timestep if timestep.ndim == 0 else timestep.reshape(-1)[:1]
            key = first * 16
            return key if not key.is_floating_point() else key.long()
        # A Python number (or none): a Python key, no tensor made from it.
        return int(float(timestep) * 16) if timestep is not None else 0


def _timestep_value(timestep: object) -> float | None:
    # The fallback for `ratio_start` (its ratio, and so the merged tensor's shape, follows the timestep)
    # where no `HostSchedule` knows this forward's timestep: one host read per forward.
    if timestep is None:
        return None
    return float(timestep.reshape(-1)[0]) if isinstance(timestep, torch.Tensor) else float(timestep)


class HostSchedule:
    """A generation's timesteps copied to the host once, and each forward's timestep found in them without a read.

    A pipeline's loop calls the model with `t` from `scheduler.timesteps` (`for t in timesteps`), or a
    view of it (`t.expand(batch)`, `t[None]`, img2img's `timesteps[t_start:]`): where it sits in the
    schedule's storage is host metadata (its address), which gives its index, and the host copy its
    value. Nothing counts steps, so two calls with one `t` (unbatched classifier-free guidance), a
    schedule that repeats timesteps (Heun, order 2) and one entered partway (img2img) all find their
    own entry. A timestep that is no view of the schedule (Flux's pipelines pass `t / 1000`) is looked
    for in the pipeline's `_current_timestep`, which the newer pipelines set to `t` before the call.
    Where neither is found, `value_for` gives None and the caller reads the timestep (one host read).

    Args:
        timesteps: the schedule, a 1-D tensor on any device (e.g. `scheduler.timesteps` right after
            `scheduler.set_timesteps`); copied to the host here, once.
        pipeline: the pipeline whose `_current_timestep` is looked at too (held weakly), or None.
    """

    def __init__(self, timesteps: torch.Tensor, pipeline: object = None) -> None:
        timesteps = timesteps.detach()
        if timesteps.ndim != 1:
            raise ValueError(f"Expected a 1-D tensor of timesteps, but got shape {tuple(timesteps.shape)}.")
        self.timesteps = timesteps  # held, so that no other tensor can take its storage's address
        self.values: list[float] = [float(v) for v in timesteps.tolist()]  # the one copy to the host
        self._pipeline = weakref.ref(pipeline) if pipeline is not None else None

    def value_for(self, timestep: object) -> float | None:
        """The schedule's value at `timestep` (a tensor that is an entry of the schedule or a view of one), or None."""
        if is_compiling():  # addresses are not traced: the caller reads the timestep as before
            return None
        index = self._index_of(timestep)
        if index is None and self._pipeline is not None:
            index = self._index_of(getattr(self._pipeline(), "_current_timestep", None))
        return None if index is None else self.values[index]

    def _index_of(self, timestep: object) -> int | None:
        base = self.timesteps
        if not isinstance(timestep, torch.Tensor) or timestep.numel() == 0:
            return None
        if timestep.dtype != base.dtype or timestep.device != base.device or timestep.is_meta:
            return None
        if timestep.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            return None
        # Its first element's offset in the schedule (stride 1), as `_timestep_value` reads the first.
        index, remainder = divmod(timestep.data_ptr() - base.data_ptr(), base.element_size() * base.stride(0))
        return index if remainder == 0 and 0 <= index < len(self.values) else None


class ForwardStates:
    """Each thread's state for one model's forwards (`ModelState`, its blocks' `BlockState`s), made at the thread's
    first forward from `template` (the model's configuration and shared caches, never itself run).

    Hooks and processors find their block's state here at every call (`block(index)`): concurrent forwards of one
    model, one per thread, never see each other's token grid, merges or step count. A copy (`copy.deepcopy`,
    `pickle`) starts with no thread's state.

    Example:
        >>> states = ForwardStates(ModelState(ToMeConfig()), num_blocks=2)
        >>> states.current is states.current, len(states.current.blocks)
        (True, 2)
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> other = ThreadPoolExecutor(1).submit(lambda: states.current).result()
        >>> other is states.current, other.skips is states.current.skips
        (False, True)
    """

    def __init__(self, template: ModelState, num_blocks: int, on_mid_forward: Any = None) -> None:
        self.template = template
        self.num_blocks = num_blocks
        #: Called where a thread's first call comes from a block or an attention instead of the model's pre-hook
        #: (the context was attached by another thread while this one's forward ran): it starts that forward.
        self.on_mid_forward = on_mid_forward
        self._local = threading.local()
        #: One holder per block, each with every thread's state of that block (`BlockSlot.state`).
        self.slots = [BlockSlot(self, index) for index in range(num_blocks)]

    @property
    def current(self) -> ModelState:
        """This thread's state (made at its first call, with its blocks' states, each handed to its `BlockSlot`)."""
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = self.template.for_thread(self.num_blocks)
            for slot, block in zip(self.slots, state.blocks, strict=True):
                slot.hold(block)
        return state

    def block(self, index: int) -> BlockState:
        """This thread's state of block `index` (a thread without one is inside a forward its model's pre-hook did
        not see start: `on_mid_forward` starts it)."""
        state = getattr(self._local, "state", None)
        if state is None:
            state = self.current
            if self.on_mid_forward is not None:
                self.on_mid_forward()
        return state.blocks[index]

    def __getstate__(self) -> dict:
        return {
            "template": self.template,
            "num_blocks": self.num_blocks,
            "on_mid_forward": self.on_mid_forward,
            "slots": self.slots,
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()


class BlockSlot:
    """One block's place in a model's `ForwardStates`: each thread's `BlockState` of that block.

    Its hooks and attention slots hold it and read `state`, one attribute of one thread-local object: no block reads
    a number of its own to find its state, so one compiled block serves every block (regional compilation guards on
    what a graph reads).
    """

    __slots__ = ("_local", "_states", "index")

    def __init__(self, states: ForwardStates, index: int) -> None:
        self._states = states
        self.index = index
        self._local = threading.local()

    @property
    def state(self) -> BlockState:
        """This thread's state of the block."""
        state = getattr(self._local, "state", None)
        if state is None:  # the thread's first call: its states are made (and a forward begun mid-way, started)
            state = self._states.block(self.index)
        return state

    def hold(self, state: BlockState) -> None:
        """Make `state` this thread's state of the block."""
        self._local.state = state

    def __getstate__(self) -> dict:  # a copy holds no thread's state
        return {"_states": self._states, "index": self.index}

    def __setstate__(self, state: dict) -> None:
        self._states = state["_states"]
        self.index = state["index"]
        self._local = threading.local()


@dataclass
class BlockState:
    """One transformer block's merge context for the current forward.

    The merge is computed lazily by whichever of attn1, attn2 or the feed-forward asks first, and
    shared by the others (computed again only if one of them has another configuration).
    """

    model: ModelState
    index: int
    metric: torch.Tensor | None = None
    merged_config: ToMeConfig | None = None
    merge: TokenMerge | None = None
    ff_merge: TokenMerge | None = None
    ff_chunk_start: int = 0  # the next sample of a feed-forward chunked over the batch (`enable_forward_chunking`)
    # This block's partitions in this forward, one per grid and layout (`ModelState.partitions`: where).
    planned: tuple[Partition, ...] = field(default=(), repr=False, compare=False)
    #: With `pays_only`: this block's factor in this forward (0: merges nothing; `ModelState.set_paying`).
    factor: int | None = None
    #: Why `merge_for` last gave None (skips.py), read only on that path.
    skipped: Skip | None = None

    def __post_init__(self) -> None:
        self.model.num_blocks = max(self.model.num_blocks, self.index + 1)
        self.model.blocks.append(self)

    def __getstate__(self) -> dict:  # a copy holds no forward's tensors (see `ModelState.__getstate__`)
        return {"model": self.model, "index": self.index, "factor": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.model.blocks.append(self)

    def reset(self) -> None:
        self.metric = None
        self.merged_config = None
        self.merge = None
        self.ff_merge = None
        self.ff_chunk_start = 0

    def grid(self, num_tokens: int) -> Grid | None:
        """The token grid of this block in the current forward, or None if it is not one."""
        if self.model.latent_hw is None:
            return None
        height, width = self.model.latent_hw
        frames = self.model.frames
        shard = self.model.shard
        extra = shard.extra if shard is not None else 0
        if extra:  # a context-parallel rank's run that ends inside a frame or row: one level, no downsampling
            whole = frames * height * width
            return Grid(height, width, 1, frames, extra) if num_tokens == whole + extra else None
        if num_tokens % frames:
            return None
        per_frame = num_tokens // frames
        downsample = level_downsample(height * width, per_frame)
        h, w = math.ceil(height / downsample), math.ceil(width / downsample)
        return Grid(h, w, downsample, frames) if h * w == per_frame else None

    def applies(self, config: ToMeConfig, grid: Grid) -> bool:
        """Whether `config` acts on this block's level at all (before any timestep schedule), and pays there."""
        level_ratio = config.level_ratio(grid.downsample, self.model.max_downsample(config))
        return level_ratio > 0 and self.pays(config, grid.downsample) > 0

    def pays(self, config: ToMeConfig, downsample: int = 1) -> int:
        """0 where `config.pays_only` and the rule turn merging off in this block for this forward; else the K/V
        pooling window side to use at this block's level `downsample` (`config.kv_factor_at`, or less where the
        rule says so)."""
        wanted = config.kv_factor_at(downsample)
        factor = self.factor
        if not config.pays_only or factor is None:
            return wanted
        return min(factor, wanted)

    def merge_for(
        self, config: ToMeConfig, text: int | None = 0, text_rows: bool = False, tail: int = 0
    ) -> TokenMerge | None:
        """The merge of this block's tokens under `config`, or None where this block is not merged.

        Args:
            text: text tokens ahead of the image tokens in the attention's sequence (Flux), which
                `TokenMerge.row_token` counts; None takes whatever merge of the image tokens alone this
                block already has (the feed-forward, which has no positions).
            text_rows: merge those text tokens along, each a row of its own (`TokenMerge.text_rows`).
            tail: tokens after the grid's, each a row of its own (`TokenMerge.tail`: a reference image's,
                Z-Image's padding and text).
        """
        if config.pays_only and self.pays(config) == 0:
            self.skipped = Skip.PAYS  # merging does not pay here (pays.py)
            return None
        if not (self.model.needs_row_token or text_rows):
            text = 0  # nothing counts the text: one merge for every caller
        # One slot (all processors of a model normally share one config), kept in attributes rather
        # than a dict: torch.compile breaks the graph at diffusers' signature lookup after a dict mutation.
        merge = self.merge
        if self.merged_config is not None and self.merged_config == config:
            if merge is None or (text is None and not merge.text_rows):
                return merge
            if merge.text == text and bool(merge.text_rows) == text_rows and merge.tail == tail:
                return merge
        merge = self._merge_or_reuse(config, text or 0, text_rows, tail)
        self.merged_config, self.merge = config, merge
        return merge

    def window_grid(self, batch: int, num_tokens: int) -> Grid | Skip:
        """The grid of each window where an attention gets this block's tokens cut into `k` whole sub-grids stacked
        along the batch (`(k * B, N / k)` tokens where the block's input is `(B, N)`), or why they are not that.

        HiDiffusion's window attention hands its blocks' `attn1` such windows (four, 2 x 2, of a grid maybe rolled
        first): each window is a grid of its own, at this block's level. Where several splits give `k` windows,
        the most even one is taken (2 x 2 for four). The split is pure integer math, cached per grid.

        Example:
            >>> state = ModelState(ToMeConfig())
            >>> block = BlockState(state, 0)
            >>> state.latent_hw, block.metric = (8, 8), torch.zeros(2, 64, 4)
            >>> block.window_grid(8, 16)
            Grid(h=4, w=4, downsample=1, frames=1, extra=0)
        """
        metric = self.metric
        if metric is None:
            return Skip.NO_BLOCK_INPUT
        if metric.ndim != 3:
            return Skip.NOT_TOKENS
        samples, tokens = metric.shape[0], metric.shape[1]
        pieces = batch // samples if samples else 0
        if pieces < 2 or pieces * samples != batch or pieces * num_tokens != tokens:
            return Skip.SHAPE
        grid = self.grid(tokens)
        if grid is None:
            return Skip.NO_GRID
        window = _window_shape(grid.h, grid.w, pieces) if grid.frames == 1 else None
        return Skip.SHAPE if window is None else Grid(*window, grid.downsample)

    def window_merge(self, config: ToMeConfig, tokens: torch.Tensor) -> TokenMerge | Skip:
        """The merge of `tokens`, this block's tokens as windows (`window_grid`): each window merged inside, as the
        grid it forms, with this block's level's ratio; or why not.

        The windows' own tokens are the similarity metric (a window may hold a rolled part of the grid, which the
        block's input does not show). Made at every call, never kept across blocks or steps: HiDiffusion draws
        another roll for each block and step.
        """
        if config.pays_only and self.pays(config) == 0:
            return Skip.PAYS
        batch, num_tokens = tokens.shape[0], tokens.shape[1]
        window = self.window_grid(batch, num_tokens)
        if isinstance(window, Skip):
            return window
        r = self._tokens_to_merge(config, window, num_tokens)
        if isinstance(r, Skip):
            return r
        model = self.model
        # `samples`: the model's batch, for tomesd's rule on odd batches (`ModelState.partitions`).
        place = model.partitions(config, window, batch, tokens.device, samples=self.metric.shape[0])
        partition = self.planned[place]
        similarity_dtype = None if config.similarity_dtype is None else getattr(torch, config.similarity_dtype)
        source_window = _source_window(config, partition)
        return match(tokens, partition, r, similarity_dtype, model.needs_row_token, 0, source_window)

    def prepare(self) -> None:
        """At the block's start (its pre-hook): on a model whose merged blocks all see one token grid and no other
        tokens (`ModelState.one_grid`), make what the forward's first merging block would otherwise make inside
        its forward and every later block find: the forward's partitions, and with `share_level` the shared
        merge. Every block's forward then runs the same code (one graph per size for all blocks when compiled
        alone); here, the first block and every later one each run one way, the later ones reading no size.
        """
        model = self.model
        config = model.config
        if not model.one_grid or config.mode != "merge" or config.recompute_every > 1:
            return
        if model._plans and (not config.share_level or model._shared):
            return  # made this forward by an earlier block (`begin` forgets them)
        metric = self.metric
        size = self._merge_size(config, metric)
        if isinstance(size, Skip):
            return
        grid, _ = size
        if config.share_level:
            self._merge_or_reuse(config, 0, False)
        elif grid.frames > 1 and config.st == 1:
            frame = Grid(grid.h, grid.w, grid.downsample)
            model.partitions(config, frame, metric.shape[0] * grid.frames, metric.device, samples=metric.shape[0])
        else:
            model.partitions(config, grid, metric.shape[0], metric.device)

    def _merge_size(self, config: ToMeConfig, metric: torch.Tensor | None) -> tuple[Grid, int] | Skip:
        """The grid of `metric` and the tokens `r` to merge away, or why this block merges nothing."""
        if metric is None:
            return Skip.NO_BLOCK_INPUT
        if metric.ndim != 3:
            return Skip.NOT_TOKENS
        num_tokens = metric.shape[1]
        grid = self.grid(num_tokens)
        if grid is None:
            return Skip.NO_GRID
        r = self._tokens_to_merge(config, grid, num_tokens)
        return r if isinstance(r, Skip) else (grid, r)

    def _tokens_to_merge(self, config: ToMeConfig, grid: Grid, num_tokens: int) -> int | Skip:
        """The tokens `r` to merge away of `num_tokens` on `grid` (this block's level), or why none."""
        model = self.model
        max_downsample = model.max_downsample(config)
        level_ratio = config.level_ratio(grid.downsample, max_downsample)
        ratio = config.ratio_at(level_ratio, model.timestep_value)
        if ratio <= 0:
            left_out = (
                grid.downsample not in dict(config.level_ratios)
                if config.level_ratios is not None
                else grid.downsample > max_downsample
            )
            return Skip.LEVEL_OFF if left_out else Skip.NOTHING_TO_MERGE
        if grid.h // config.sy == 0 or grid.w // config.sx == 0:
            return Skip.SMALL_GRID
        if grid.frames > 1 and grid.frames // config.st == 0:
            return Skip.FEW_FRAMES
        if grid.extra and grid.frames > 1 and config.st == 1:
            return Skip.SHARD_FRAMES  # a rank's frames counted from mid-frame (`LocalGrid`) pair across frames only
        r = min(int(num_tokens * ratio), _num_sources(grid, config))
        if grid.frames > 1 and config.st == 1:
            r -= r % grid.frames  # merged frame by frame: as many tokens from every frame
        return r if r > 0 else Skip.NOTHING_TO_MERGE

    def _merge_or_reuse(self, config: ToMeConfig, text: int, text_rows: bool, tail: int = 0) -> TokenMerge | None:
        metric = self.metric
        size = self._merge_size(config, metric)
        if isinstance(size, Skip):
            self.skipped = size
            return None
        grid, r = size
        batch = metric.shape[0]
        model = self.model
        # A merge shared by several blocks is made of the image tokens alone; blocks that merge the text
        # along extend it (once, kept on the merge).
        rows = 0 if config.share_level or not text_rows else text
        merge = None
        if config.share_level:  # one merge per level and forward, from the level's first block
            shared_key = (config, grid, batch, r, text)
            merge = next((shared for key, shared in model._shared if key == shared_key), None)
        if merge is None:
            merge = self._kept_or_computed(config, metric, grid, r, text, rows, 0 if config.share_level else tail)
            if config.share_level:
                model._shared = (*model._shared, (shared_key, merge))
        if text_rows and not merge.text_rows:
            merge = merge.with_text_rows(text)
        return merge.with_tail_rows(tail) if tail != merge.tail else merge

    def _kept_or_computed(
        self, config: ToMeConfig, metric: torch.Tensor, grid: Grid, r: int, text: int, rows: int, tail: int = 0
    ) -> TokenMerge:
        if config.recompute_every <= 1:
            return self._compute(config, metric, grid, r, text, rows, tail)
        model = self.model
        block = -1 if config.share_level else self.index
        kept_key = (config, block, model.branch, metric.shape[0], grid, r, text, rows, tail)
        kept = model.kept.get(kept_key)
        if kept is not None and model.step - kept.step < config.recompute_every:
            return kept.merge
        merge = self._compute(config, metric, grid, r, text, rows, tail)
        if len(model.kept) >= _MAX_KEPT_MERGES:
            model.kept.clear()
        model.kept[kept_key] = _KeptMerge(merge, model.step)
        return merge

    def _compute(
        self, config: ToMeConfig, metric: torch.Tensor, grid: Grid, r: int, text: int, rows: int, tail: int = 0
    ) -> TokenMerge:
        similarity_dtype = None if config.similarity_dtype is None else getattr(torch, config.similarity_dtype)
        if grid.frames > 1 and config.st == 1:
            return self._compute_per_frame(config, metric, grid, r, similarity_dtype)
        place = self.model.partitions(config, grid, metric.shape[0], metric.device, text, rows)
        partition = self.planned[place]  # read after `partitions`, which may have handed it over
        windows = _source_window(config, partition)
        return match(metric, partition, r, similarity_dtype, self.model.needs_row_token, tail, windows)

    def _compute_per_frame(
        self, config: ToMeConfig, metric: torch.Tensor, grid: Grid, r: int, similarity_dtype: torch.dtype | None
    ) -> TokenMerge:
        # tomesd frame by frame: the frames are the batch of one matching (windows and destinations inside
        # a frame, the same destination places in every frame), each frame losing r / frames tokens.
        batch, num_tokens, channels = metric.shape
        frames = grid.frames
        frame = Grid(grid.h, grid.w, grid.downsample)
        place = self.model.partitions(config, frame, batch * frames, metric.device, samples=batch)
        partition = self.planned[place]
        per_frame = metric.reshape(batch * frames, num_tokens // frames, channels)
        windows = _source_window(config, partition)
        merge = match(per_frame, partition, r // frames, similarity_dtype, self.model.needs_row_token, 0, windows)
        return fold_frames(merge, batch, frames)


@functools.lru_cache(maxsize=64)
def _window_shape(h: int, w: int, pieces: int) -> tuple[int, int] | None:
    """`(h, w)` of each of `pieces` whole sub-grids of an `h x w` grid, in rows and columns of windows as near
    equal in number as the grid allows (more rows of windows on a tie); None where no split is whole."""
    splits = [
        (rows, pieces // rows)
        for rows in range(1, pieces + 1)
        if pieces % rows == 0 and h % rows == 0 and w % (pieces // rows) == 0
    ]
    if not splits:
        return None
    rows, columns = min(splits, key=lambda split: (abs(split[0] - split[1]), -split[0]))
    return h // rows, w // columns


def _source_window(config: ToMeConfig, partition: Partition) -> torch.Tensor | None:
    """Each source's window under window matching (from the layout the partition was made from), else None."""
    return partition.layout.source_window if config.matching == "window" else None


def _num_sources(grid: Grid, config: ToMeConfig) -> int:
    if grid.frames > 1 and config.st > 1:
        return grid.tokens - (grid.frames // config.st) * (grid.h // config.sy) * (grid.w // config.sx)
    return grid.tokens - grid.frames * (grid.h // config.sy) * (grid.w // config.sx)


#: Attribute set on each mergeable attention module while ToMe is applied: an `AttentionSlot`.
SLOT_ATTR = "_tome_slot"


class AttentionSlot:
    """Where an attention module sits: its block's state, self- or cross-attention, its token layout, the
    processor class its model builds it with (what a `ToMeProcessor()` without an inner one runs), and its name
    in the model (for what `skip` says)."""

    __slots__ = ("_block", "built_with", "is_cross", "layout", "mask_at", "name", "rotary_at")

    def __init__(
        self,
        block: BlockSlot,
        is_cross: bool,
        layout: Layout = Layout.IMAGE,
        built_with: type | None = None,
        mask_at: int = 1,
        rotary_at: int | None = None,
        name: str = "",
    ) -> None:
        self._block = block
        self.is_cross = is_cross
        self.layout = layout
        self.built_with = built_with
        self.mask_at = mask_at  # positions after hidden_states where the module passes them (`AttentionSite`)
        self.rotary_at = rotary_at
        self.name = name

    @property
    def block(self) -> BlockState:
        """Its block's state in this thread's forward."""
        return self._block.state

    def skip(self, reason: Skip, tokens: torch.Tensor | None = None) -> None:
        """Report that this attention runs unmerged for `reason` (`skips.report_skip`; once per model and reason)."""
        report_skip(self.block.model.skips, self.block.model.forward_skip or reason, self.name, tokens)
