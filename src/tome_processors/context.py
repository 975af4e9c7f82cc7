"""Per-forward state shared by the hooks and the processors of one model.

`ModelState` holds what the model's forward tells us (latent size, timestep, step count) and the
merges kept for reuse; `BlockState` holds, for one transformer block and one forward, the raw block
input and the merges computed from it. Hooks fill and clear them; processors only read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .config import ToMeConfig
from .families import Layout
from .merge import TokenMerge, bipartite_soft_matching_2d, level_downsample, window_choice

_MASK31 = 0x7FFFFFFF
_MAX_KEPT_MERGES = 256  # bound on merges kept for reuse across blocks/steps


class Grid(NamedTuple):
    """A block's token grid: `h x w` tokens at `downsample` times below the latent."""

    h: int
    w: int
    downsample: int


@dataclass
class _KeptMerge:
    merge: TokenMerge | None
    step: int
    forward: int


@dataclass
class ModelState:
    """What one forward of the model tells the blocks.

    Attributes:
        config: the configuration the hooks were installed with.
        auto_downsample: what `max_downsample="auto"` means on this model.
        latent_hw: `(H, W)` of the model's `sample` in the current (or last) forward.
        step_key: long tensor of one element derived from the timestep; keys the random choice.
        timestep: the timestep as a number, read only when a schedule or reuse needs it.
        step: denoising steps seen in the current generation (a new timestep is a new step; a
            larger one starts a new generation).
        forward: forwards seen, so merges shared within a forward are not reused in the next.
        kept: merges kept for `share_level` / `recompute_every`.
    """

    config: ToMeConfig
    auto_downsample: int = 1
    needs_row_token: bool = False
    latent_hw: tuple[int, int] | None = None
    step_key: torch.Tensor | None = None
    timestep: float | None = None
    step: int = 0
    forward: int = 0
    kept: dict[tuple, _KeptMerge] = field(default_factory=dict)

    def reset(self) -> None:
        self.latent_hw = None
        self.step_key = None
        self.timestep = None
        self.step = 0
        self.kept.clear()

    def begin(self, latent_hw: tuple[int, int], device: torch.device, timestep: object, read_timestep: bool) -> None:
        """Record the token grid (a UNet's latent, a transformer's patch grid) and timestep of a forward."""
        self.latent_hw = latent_hw
        self.step_key = step_key_from_timestep(timestep, device)
        if self.config.share_level:  # a counter changing every call would make torch.compile recompile
            self.forward += 1
        if not read_timestep or timestep is None:
            self.timestep = None
            return
        # A host read of one number: only schedules and reuse across steps need it.
        value = float(timestep.reshape(-1)[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
        if self.timestep is None or value > self.timestep:
            self.step = 0  # a new generation
            self.kept.clear()
        elif value != self.timestep:
            self.step += 1
        self.timestep = value

    def max_downsample(self, config: ToMeConfig) -> int:
        return self.auto_downsample if config.max_downsample == "auto" else int(config.max_downsample)


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

    def reset(self) -> None:
        self.metric = None
        self.merged_config = None
        self.merge = None
        self.ff_merge = None

    def grid(self, num_tokens: int) -> Grid | None:
        """The token grid of this block in the current forward, or None if it is not one."""
        if self.model.latent_hw is None:
            return None
        height, width = self.model.latent_hw
        downsample = level_downsample(height * width, num_tokens)
        h, w = math.ceil(height / downsample), math.ceil(width / downsample)
        return Grid(h, w, downsample) if h * w == num_tokens else None

    def applies(self, config: ToMeConfig, grid: Grid) -> bool:
        """Whether `config` acts on this block's level at all (before any timestep schedule)."""
        return config.level_ratio(grid.downsample, self.model.max_downsample(config)) > 0

    def merge_for(self, config: ToMeConfig) -> TokenMerge | None:
        """The merge of this block's tokens under `config`, or None where this block is not merged."""
        # One slot (all processors of a model normally share one config), kept in attributes rather
        # than a dict: torch.compile breaks the graph at diffusers' signature lookup after a dict mutation.
        if self.merged_config is not None and self.merged_config == config:
            return self.merge
        merge = self._merge_or_reuse(config)
        self.merged_config, self.merge = config, merge
        return merge

    def _merge_or_reuse(self, config: ToMeConfig) -> TokenMerge | None:
        metric = self.metric
        if metric is None or metric.ndim != 3:
            return None
        batch, num_tokens, _ = metric.shape
        grid = self.grid(num_tokens)
        if grid is None:
            return None
        level_ratio = config.level_ratio(grid.downsample, self.model.max_downsample(config))
        r = int(num_tokens * config.ratio_at(level_ratio, self.model.timestep))
        if r <= 0:
            return None
        if not (config.share_level or config.recompute_every > 1):
            return self._compute(config, metric, grid, r)

        model = self.model
        owner = -1 if config.share_level else self.index
        key = (config, owner, batch, model.latent_hw, r)
        kept = model.kept.get(key)
        fresh = kept is not None and (
            model.step - kept.step < config.recompute_every
            if config.recompute_every > 1
            else model.config.share_level and kept.forward == model.forward
        )
        if fresh:
            return kept.merge
        merge = self._compute(config, metric, grid, r)
        if len(model.kept) >= _MAX_KEPT_MERGES:
            model.kept.clear()
        model.kept[key] = _KeptMerge(merge, model.step, model.forward)
        return merge

    def _compute(self, config: ToMeConfig, metric: torch.Tensor, grid: Grid, r: int) -> TokenMerge:
        choice = None
        hsy, wsx = grid.h // config.sy, grid.w // config.sx
        # An odd batch cannot hold matching prompted/unprompted halves: no randomness (as tomesd).
        if config.use_rand and metric.shape[0] % 2 == 0 and hsy > 0 and wsx > 0:
            choice = window_choice(hsy, wsx, config.sx * config.sy, self._random_key(config, metric.device))
        similarity_dtype = None if config.similarity_dtype is None else getattr(torch, config.similarity_dtype)
        return bipartite_soft_matching_2d(
            metric, grid.h, grid.w, config.sx, config.sy, r, choice, similarity_dtype, self.model.needs_row_token
        )

    def _random_key(self, config: ToMeConfig, device: torch.device) -> torch.Tensor:
        base = (config.seed * 104_729 + self.index * 7_919) & _MASK31
        step = self.model.step_key
        if step is None:
            return torch.tensor([base], device=device)
        return (step.to(device) * 1_000_003 + base) & _MASK31


def step_key_from_timestep(timestep: object, device: torch.device) -> torch.Tensor | None:
    """A long tensor of one element from the model's `timestep` argument (tensor or number)."""
    if timestep is None:
        return None
    if not isinstance(timestep, torch.Tensor):
        timestep = torch.tensor(float(timestep), device=device)
    # Sixteenths of a step tell fractional (Karras/Euler) timesteps apart; no host sync needed.
    return (timestep.reshape(-1)[:1].float() * 16).round().long() & _MASK31


#: Attribute set on each mergeable attention module while ToMe is applied: an `AttentionSlot`.
SLOT_ATTR = "_tome_slot"


class AttentionSlot:
    """Where an attention module sits: its block's state, self- or cross-attention, its token layout."""

    __slots__ = ("block", "is_cross", "layout")

    def __init__(self, block: BlockState, is_cross: bool, layout: Layout = Layout.IMAGE) -> None:
        self.block = block
        self.is_cross = is_cross
        self.layout = layout
