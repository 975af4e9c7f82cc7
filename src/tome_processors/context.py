"""Per-forward state shared by the hooks and the processors of one model.

`ModelState` holds what the model's forward tells us (latent size, timestep); `BlockState` holds,
for one transformer block and one forward, the raw block input and the merges computed from it.
Hooks fill and clear them; processors only read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .config import ToMeConfig
from .merge import TokenMerge, bipartite_soft_matching_2d, level_downsample, window_choice

_MASK31 = 0x7FFFFFFF


@dataclass
class ModelState:
    """What one forward of the model tells the blocks.

    Attributes:
        config: the configuration the hooks were installed with.
        auto_downsample: what `max_downsample="auto"` means on this model.
        latent_hw: `(H, W)` of the model's `sample` in the current (or last) forward.
        step_key: long tensor of one element derived from the timestep; keys the random choice.
    """

    config: ToMeConfig
    auto_downsample: int = 1
    latent_hw: tuple[int, int] | None = None
    step_key: torch.Tensor | None = None

    def reset(self) -> None:
        self.latent_hw = None
        self.step_key = None

    def max_downsample(self, config: ToMeConfig) -> int:
        return self.auto_downsample if config.max_downsample == "auto" else int(config.max_downsample)


@dataclass
class BlockState:
    """One transformer block's merge context for the current forward.

    The merge is computed lazily, once per configuration, by whichever of attn1, attn2 or the
    feed-forward asks first, and shared by the others.
    """

    model: ModelState
    index: int
    metric: torch.Tensor | None = None
    merges: dict[ToMeConfig, TokenMerge | None] = field(default_factory=dict)
    ff_merge: TokenMerge | None = None

    def reset(self) -> None:
        self.metric = None
        self.merges.clear()
        self.ff_merge = None

    def merge_for(self, config: ToMeConfig) -> TokenMerge | None:
        """The merge of this block's tokens under `config`, or None where this block is not merged."""
        if config in self.merges:
            return self.merges[config]
        merge = self._compute(config)
        self.merges[config] = merge
        return merge

    def _compute(self, config: ToMeConfig) -> TokenMerge | None:
        metric, latent_hw = self.metric, self.model.latent_hw
        if metric is None or latent_hw is None or metric.ndim != 3 or config.ratio == 0:
            return None
        batch, num_tokens, _ = metric.shape
        height, width = latent_hw
        downsample = level_downsample(height * width, num_tokens)
        if downsample > self.model.max_downsample(config):
            return None
        h, w = math.ceil(height / downsample), math.ceil(width / downsample)
        if h * w != num_tokens:  # not a token grid of this latent: leave it alone
            return None
        choice = None
        # An odd batch cannot hold matching prompted/unprompted halves: no randomness (as tomesd).
        if config.use_rand and batch % 2 == 0 and h // config.sy > 0 and w // config.sx > 0:
            choice = window_choice(
                h // config.sy, w // config.sx, config.sx * config.sy, self._random_key(config, metric.device)
            )
        return bipartite_soft_matching_2d(
            metric, h, w, config.sx, config.sy, int(num_tokens * config.ratio), choice
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
