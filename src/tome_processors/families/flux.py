"""FLUX.1: double-stream (joint) then single-stream (text first) blocks over packed tokens, the grid from `img_ids`."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from diffusers import FluxTransformer2DModel

from .._similarity import is_compiling
from ..arguments import argument
from .base import Family, Layout, Rotary, Stack


class IdsGridFamily(Family):
    """A family whose model gets packed tokens `(B, N, C)` and reads its grid from `img_ids` (FLUX.1, FLUX.2, Chroma).

    `img_ids` number rows in column 1 and columns in column 2, row-major from 0, as the Flux pipelines build
    them. Inputs whose `img_ids` are not one such grid (e.g. Kontext's appended reference image) are not
    merged. Subclasses declare `ids_position`, where `img_ids` sits in the model's forward.
    """

    needs_row_token = True
    rotary = Rotary()
    timestep_scale = 1000.0  # the Flux pipelines pass sigma (0..1) as the timestep
    merge_only = True
    ids_position = 4

    def __init__(self) -> None:
        self._last: tuple[weakref.ref, object, int, tuple[int, int] | None] | None = None
        self._warned = False

    def generation_marker(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """`img_ids`: the Flux pipelines pass `t / 1000` (a new tensor every call) but make `img_ids` once per call."""
        if is_compiling():
            return None
        ids = argument(args, kwargs, self.ids_position, "img_ids")
        return ids if isinstance(ids, torch.Tensor) else None

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        ids = argument(args, kwargs, self.ids_position, "img_ids")
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or not isinstance(ids, torch.Tensor):
            return None
        given = ids  # the object the pipeline passes every step (a 3-D one is sliced below)
        last = self._last
        if is_compiling():  # reading ids is a host sync torch.compile cannot trace: the grid an eager call read
            return last[3] if last is not None and last[2] == x.shape[1] else None
        # Pipelines pass the same img_ids every step: read them once. A version counter tells an in-place
        # change; inference tensors have none, so there the storage and shape stand for it.
        version = (-1, given.data_ptr(), tuple(given.shape)) if given.is_inference() else given._version
        if last is not None and last[0]() is given and last[1:3] == (version, x.shape[1]):
            return last[3]
        if ids.ndim == 3:
            ids = ids[0]
        grid = grid_from_ids(ids, int(x.shape[1]))
        self._last = (weakref.ref(given), version, int(x.shape[1]), grid)
        if grid is None and not self._warned:
            self._warned = True
            warnings.warn(
                f"ToMe merges nothing in this {type(model).__name__} call: expected img_ids numbering the rows and "
                f"columns of one row-major grid of the {int(x.shape[1])} image tokens, but got img_ids of shape "
                f"{tuple(ids.shape)} that do not.",
                UserWarning,
                stacklevel=2,
            )
        return grid


class FluxFamily(IdsGridFamily):
    """`FluxTransformer2DModel`: double-stream (joint) then single-stream (text first) blocks."""

    name = "flux"
    model_class = FluxTransformer2DModel
    stacks = (
        Stack("transformer_blocks", Layout.JOINT, feed_forward="ff"),
        Stack("single_transformer_blocks", Layout.TEXT_FIRST),
    )
    timestep_position = 3
    ids_position = 4
    defaults: dict[str, Any] = {"ratio": 0.3}
    presets: dict[str, dict[str, Any]] = {
        "exact": {},
        # Lower ratios than PixArt's and SD3's: a merged row also loses its tokens' rotary positions.
        "balanced": {"share_level": True},
        "fast": {"ratio": 0.5, "share_level": True},
    }


def grid_from_ids(ids: torch.Tensor, num_tokens: int) -> tuple[int, int] | None:
    """`(h, w)` when `ids[:, 1]` / `ids[:, 2]` number the rows / columns of a row-major grid of `num_tokens`.

    Example:
        >>> ids = torch.zeros(2, 3, 3)
        >>> ids[..., 1] = torch.arange(2)[:, None]
        >>> ids[..., 2] = torch.arange(3)[None]
        >>> grid_from_ids(ids.view(6, 3), 6)
        (2, 3)
        >>> grid_from_ids(ids.view(6, 3).flip(0), 6) is None
        True
    """
    if ids.ndim != 2 or ids.shape[0] != num_tokens or ids.shape[1] < 3 or num_tokens == 0:
        return None
    rows, cols = ids[:, 1].round().long(), ids[:, 2].round().long()
    h, w = int(rows.max()) + 1, int(cols.max()) + 1
    if h * w != num_tokens:
        return None
    expected = torch.arange(num_tokens, device=ids.device)
    return (h, w) if torch.equal(rows * w + cols, expected) else None
