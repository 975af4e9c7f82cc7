"""Context parallelism: the part of the token grid that one rank's blocks see.

Under diffusers' context parallelism (`model.enable_parallelism(config=ContextParallelConfig(...))`) each rank's
blocks get one contiguous run of the flattened token sequence, `tokens.chunk(P, dim=1)[rank]` over the P ranks of
the ring x Ulysses mesh; for a video, frame-major. The model's forward pre-hook sees the whole input, so the grid it
reads is the whole one: this module turns it into the grid of one shard, which each rank merges on its own (the
same merged count on every rank, so the collectives stay equal-sized), while attention stays global.

A shard is merged as:
- whole frames where the frames divide by P (`(F / P, H, W)`: as one process merges those frames);
- else, where merging spans frames (`st` > 1) and the shard holds `st` frames' worth of tokens or more: frames of
  `H x W` tokens counted from the shard's first token. Each such frame is a real frame's last rows above the next
  frame's first rows (the frame's rows turned by the shard's offset), and the same token of the next such frame is
  the same place one frame later, so windows across frames pair the same places, as in one process; the tokens after
  the last whole such frame (`extra`, less than a frame) are merged as the grid's edges: each may merge into the
  window at its own place one frame earlier (`GridLayout.extra`);
- else rows of the image's width, counted from the shard's first token: one grid of `N / (P W)` rows, merged as an
  image (a shard that starts mid-frame holds the end of one frame above the start of the next, so a window may span
  the two where the frame's rows are not a multiple of the window's; no merging across frames there).
  Where the shard starts mid-row (Wan at 720p: 45 rows a frame, 21 frames, on 2, 4 or 8 ranks), each of its rows is
  the end of one image row followed by the start of the next: the image's columns turned by the shard's offset, so
  every vertical neighbour is a real one and one horizontal pair a row is not. The tokens after the last whole row of
  the shard (`extra`, fewer than a row) are edges that may merge into the window above them; every rank holds as many
  rows and as long a rest, so every rank merges as many tokens;
- else (a shard shorter than one row, or tokens that do not divide by P) not at all, with one warning (skips.py).

Where other tokens open the split sequence ahead of the grid's (`lead`: MiniMax-H3's text and audio ahead of its
video), the ranks hold unequal shares of the grid: the first rank the lead and the grid's start, the others the grid
alone. Every rank then merges the last `k` grid tokens of its run, `k` the fewest any rank holds, as rows (or frames)
counted from the first of them; the tokens of its run ahead of those (`LocalGrid.lead`) pass through as the text
does. Every rank merges as many tokens; a rank holding more of the grid merges a smaller share of it.

Example:
    >>> local_grid((4, 8, 8), Shards(2, 1))
    LocalGrid(frames=2, h=8, w=8, start=128, whole_tokens=256, extra=0, lead=0)
    >>> local_grid((1, 8, 6), Shards(4, 0)).h
    2
    >>> local_grid((3, 3, 4), Shards(2, 1))  # 18 tokens a rank: 4 rows of 4 from token 18 on, and 2 after them
    LocalGrid(frames=1, h=4, w=4, start=18, whole_tokens=36, extra=2, lead=0)
    >>> local_grid((2, 4, 4), Shards(2, 1), lead=6)  # 19 a rank: rank 0's last 13 grid tokens, rank 1's too
    LocalGrid(frames=1, h=3, w=4, start=19, whole_tokens=38, extra=1, lead=6)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["LocalGrid", "Shards", "local_grid", "sequence_shards"]


class Shards(NamedTuple):
    """How the token sequence is split: `count` equal runs, this rank holding run `rank`."""

    count: int
    rank: int


@dataclass(frozen=True)
class LocalGrid:
    """The grid of one rank's tokens: `frames` x `h` x `w`, its run starting at token `start` of the `whole_tokens`
    the sequence splits."""

    frames: int
    h: int
    w: int
    start: int
    whole_tokens: int
    #: Tokens after the grid's (a shard that ends mid-row or mid-frame): fewer than a frame (a row where `frames`
    #: is 1), merged as the grid's edges (`GridLayout.extra`).
    extra: int = 0
    #: Tokens of the run ahead of its grid, passed through unmerged (a sequence that opens with other tokens).
    lead: int = 0

    @property
    def tokens(self) -> int:
        """The grid tokens this rank merges from."""
        return self.frames * self.h * self.w + self.extra

    @property
    def run(self) -> int:
        """The tokens this rank holds."""
        return self.lead + self.tokens


def sequence_shards(model: torch.nn.Module) -> Shards | None:
    """How `model`'s token sequence is split under diffusers' context parallelism, or None where it is not.

    Read from the config diffusers records on the model (`enable_parallelism`, `from_pretrained(parallel_config=)`):
    the flattened ring x Ulysses mesh's size and this process's rank in it (what diffusers' split uses). Tensor
    parallelism splits no tokens: None.

    Example:
        >>> sequence_shards(torch.nn.Linear(1, 1)) is None
        True
    """
    config: Any = getattr(model, "_parallel_config", None)
    context = getattr(config, "context_parallel_config", None)
    mesh = getattr(context, "_flattened_mesh", None)
    if mesh is None:
        return None
    count = mesh.size()
    return Shards(count, mesh.get_local_rank()) if count > 1 else None


def uneven_split(context: Any) -> bool:
    """Whether diffusers splits the sequence unevenly (`ulysses_anything`, `ring_anything`)."""
    return bool(getattr(context, "ulysses_anything", False) or getattr(context, "ring_anything", False))


def local_grid(grid: tuple[int, ...], shards: Shards, window_frames: int = 1, lead: int = 0) -> LocalGrid | None:
    """The grid of the tokens rank `shards.rank` holds of the whole `grid` (`(H, W)` or `(F, H, W)`), or None where
    they form none (the tokens do not divide by the ranks, or a shard is shorter than a row). `window_frames`: the
    frames one merge window spans (`ToMeConfig.st`); `lead`: tokens ahead of the grid's in the split sequence.
    Module doc: how.

    Example:
        >>> local_grid((3, 4, 4), Shards(2, 0))  # 24 tokens: 6 rows of 4, across frames 0 and 1
        LocalGrid(frames=1, h=6, w=4, start=0, whole_tokens=48, extra=0, lead=0)
        >>> local_grid((5, 2, 4), Shards(2, 1), window_frames=2)  # 20 tokens from mid-frame: 2 frames of 8, 4 after
        LocalGrid(frames=2, h=2, w=4, start=20, whole_tokens=40, extra=4, lead=0)
        >>> local_grid((1, 3, 3), Shards(2, 0)) is None
        True
    """
    frames, height, width = (1, *grid) if len(grid) == 2 else grid
    whole = lead + frames * height * width
    if whole % shards.count:
        return None
    run = whole // shards.count
    start = shards.rank * run
    # The grid tokens each rank merges from: the last `tokens` of its run, as many on every rank (the first rank's,
    # behind the lead, are the fewest).
    tokens = run - lead
    if tokens <= 0:
        return None
    ahead = run - tokens  # this rank's tokens before them
    if lead == 0 and frames % shards.count == 0:
        return LocalGrid(frames // shards.count, height, width, start, whole)
    frame = height * width
    if frames > 1 and window_frames > 1 and tokens // frame >= window_frames:  # frames from the first grid token
        return LocalGrid(tokens // frame, height, width, start, whole, extra=tokens % frame, lead=ahead)
    if tokens >= width:  # rows of the width from the first grid token; what is left of a row after them: `extra`
        return LocalGrid(1, tokens // width, width, start, whole, extra=tokens % width, lead=ahead)
    return None
