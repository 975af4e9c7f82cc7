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

    `img_ids` number rows in column 1 and columns in column 2, row-major (from 0 as the Flux pipelines build
    them, or from any first row and column). Inputs whose `img_ids` are not one such grid (e.g. Kontext's
    appended reference image) are not merged, but on families with `reference_tail` (FLUX.2): there the
    generated image's tokens (time coordinate `generated_time`, column 0) lead and form the grid, and the
    reference images' tokens after them (their own time coordinates) are the model's tail
    (`trailing_tokens`), never merged. Subclasses declare `ids_position` (and `ids_name`), where the ids sit
    in the model's forward, and `image_ids` where they cover more than the image input (Krea 2's text).
    """

    guidance_in_batch = False  # called once per guidance branch, at batch 1

    needs_row_token = True
    rotary = Rotary()
    pipeline_patch = 2  # the Flux-like pipelines pack 2 x 2 latent pixels into one token
    timestep_scale = 1000.0  # the Flux pipelines pass sigma (0..1) as the timestep
    merge_only = True
    ids_position = 4
    #: The forward's name for the ids (Krea 2 calls them `position_ids`).
    ids_name = "img_ids"
    #: Whether reference images' tokens may follow the grid's (their blocks' spans must then say where it is).
    reference_tail = False
    #: The time coordinate (`ids[:, 0]`) of the generated image's tokens where reference images follow them
    #: (`reference_tail`): 0 on FLUX.2, 1 on LongCat-Image-Edit (its reference image is at 2).
    generated_time = 0.0

    def __init__(self) -> None:
        self._last: tuple[weakref.ref, object, int, tuple[int, int] | None] | None = None
        self._warned = False

    def __getstate__(self) -> dict:  # a copy reads its img_ids afresh (the last read holds a weak reference)
        return {**vars(self), "_last": None}

    def generation_marker(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """`img_ids`: the Flux pipelines pass `t / 1000` (a new tensor every call) but make `img_ids` once per call."""
        if is_compiling():
            return None
        ids = argument(args, kwargs, self.ids_position, self.ids_name)
        return ids if isinstance(ids, torch.Tensor) else None

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        ids = argument(args, kwargs, self.ids_position, self.ids_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or not isinstance(ids, torch.Tensor):
            return None
        if is_compiling():
            # Reading ids is a host sync that a graph cannot hold: read them outside it (a graph break).
            return _read_grid_outside_the_graph(self, model, ids, x.shape[1])
        return self._read_grid(model, ids, int(x.shape[1]))

    def hinted_grid(
        self, model: torch.nn.Module, args: tuple, kwargs: dict, hint: tuple[int, int]
    ) -> tuple[int, int] | None:
        """The pipeline's grid where this forward has its token count (the hint's ints are guarded by a graph)."""
        x = argument(args, kwargs, 0, "hidden_states")
        if isinstance(x, torch.Tensor) and x.ndim == 3 and x.shape[1] == hint[0] * hint[1]:
            return hint
        return self.token_grid(model, args, kwargs)

    def trailing_tokens(self, args: tuple, kwargs: dict, grid: tuple[int, ...]) -> int:
        """The reference images' tokens after the grid's (`reference_tail` families), else 0."""
        x = argument(args, kwargs, 0, "hidden_states")
        if not self.reference_tail or not isinstance(x, torch.Tensor) or x.ndim != 3:
            return 0
        return max(int(x.shape[1]) - grid[-2] * grid[-1], 0)

    def grid_of_ids(self, ids: object) -> tuple[int, int] | None:
        """`(h, w)` where `ids` (a pipeline's `img_ids`, one row per image token) number one row-major grid."""
        if not isinstance(ids, torch.Tensor) or ids.ndim not in (2, 3) or ids.shape[-1] < 3:
            return None
        flat = ids[0] if ids.ndim == 3 else ids
        return grid_from_ids(flat, flat.shape[0])

    def image_ids(self, ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The rows of the forward's ids (`(S, C)`, or `(B, S, C)`: the first sample's) that number the model's
        `num_tokens` image-token inputs: all of them on families whose ids cover the image input alone."""
        return ids[0] if ids.ndim == 3 else ids

    def grid_of_image_ids(self, ids: torch.Tensor, num_tokens: int) -> tuple[int, int] | None:
        """`(h, w)` of the grid that `ids` (`image_ids`' rows) number for the model's `num_tokens` image-token
        inputs: one row per token, row-major (`grid_from_ids`), on every family but those whose image input holds
        other tokens too (Ideogram 4's packed sequence). Read on the host once per ids tensor (`_read_grid`)."""
        return grid_from_ids(ids, num_tokens)

    def _read_grid(self, model: torch.nn.Module, ids: torch.Tensor, num_tokens: int) -> tuple[int, int] | None:
        given = ids  # the object the pipeline passes every step (a 3-D one is sliced below)
        last = self._last
        # Pipelines pass the same img_ids every step: read them once. A version counter tells an in-place
        # change; inference tensors have none, so there the storage and shape stand for it.
        version = (-1, given.data_ptr(), tuple(given.shape)) if given.is_inference() else given._version
        if last is not None and last[0]() is given and last[1:3] == (version, num_tokens):
            return last[3]
        ids = self.image_ids(ids, num_tokens)
        grid = self.grid_of_image_ids(ids, num_tokens)
        if grid is None and self.reference_tail:
            grid = leading_grid_from_ids(ids, num_tokens, self.generated_time)
        self._last = (weakref.ref(given), version, num_tokens, grid)
        if grid is None and not self._warned:
            self._warned = True
            warnings.warn(
                f"ToMe merges nothing in this {type(model).__name__} call: expected img_ids numbering the rows and "
                f"columns of one row-major grid of the {num_tokens} image tokens, but got img_ids of shape "
                f"{tuple(ids.shape)} that do not.",
                UserWarning,
                stacklevel=2,
            )
        return grid


@torch.compiler.disable
def _read_grid_outside_the_graph(
    family: IdsGridFamily, model: torch.nn.Module, ids: torch.Tensor, num_tokens: int
) -> tuple[int, int] | None:
    return family._read_grid(model, ids, int(num_tokens))


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
    # A merged row also loses its tokens' rotary positions, so `exact` keeps a lower ratio than PixArt's and
    # SD3's. Window matching keeps merged tokens beside their destination: on the trained FLUX-shaped model it
    # changes the noise prediction less at 0.5 with one matching per forward than global matching does at
    # 0.3 (11.32% against 11.98%; docs/options.md).
    presets: dict[str, dict[str, Any]] = {
        "exact": {},
        "balanced": {"ratio": 0.5, "matching": "window", "share_level": True},
        "fast": {"ratio": 0.7, "matching": "window", "share_level": True},
    }


def grid_from_ids(ids: torch.Tensor, num_tokens: int) -> tuple[int, int] | None:
    """`(h, w)` when `ids[:, 1]` / `ids[:, 2]` number the rows / columns of a row-major grid of `num_tokens`.

    The numbering may start anywhere: LongCat-Image's pipeline places its image at row and column 512, after
    the text's positions. Only the order counts, as the rotary tables are built from the ids themselves.

    Example:
        >>> ids = torch.zeros(2, 3, 3)
        >>> ids[..., 1] = torch.arange(2)[:, None]
        >>> ids[..., 2] = torch.arange(3)[None]
        >>> grid_from_ids(ids.view(6, 3), 6)
        (2, 3)
        >>> grid_from_ids(ids.view(6, 3) + 512, 6)
        (2, 3)
        >>> grid_from_ids(ids.view(6, 3).flip(0), 6) is None
        True
    """
    if ids.ndim != 2 or ids.shape[0] != num_tokens or ids.shape[1] < 3 or num_tokens == 0:
        return None
    rows, cols = ids[:, 1].round().long(), ids[:, 2].round().long()
    rows, cols = rows - rows.min(), cols - cols.min()
    h, w = int(rows.max()) + 1, int(cols.max()) + 1
    if h * w != num_tokens:
        return None
    expected = torch.arange(num_tokens, device=ids.device)
    return (h, w) if torch.equal(rows * w + cols, expected) else None


def leading_grid_from_ids(ids: torch.Tensor, num_tokens: int, time: float = 0.0) -> tuple[int, int] | None:
    """`(h, w)` of the grid that the leading tokens at time coordinate `time` (`ids[:, 0]`) number, followed by
    tokens at other time coordinates (FLUX.2's reference images); None where there is no such split.

    Example:
        >>> ids = torch.zeros(6 + 2, 4)
        >>> ids[:6, 1], ids[:6, 2] = torch.arange(6) // 3, torch.arange(6) % 3
        >>> ids[6:, 0] = 10.0  # a reference image's two tokens
        >>> leading_grid_from_ids(ids, 8)
        (2, 3)
        >>> leading_grid_from_ids(ids, 8, time=10.0) is None  # the reference's tokens do not lead
        True
    """
    if ids.ndim != 2 or ids.shape[0] != num_tokens or ids.shape[1] < 3 or num_tokens == 0:
        return None
    others = torch.nonzero(ids[:, 0] != time)  # a host sync, once per img_ids tensor (the grid is kept)
    if others.numel() == 0 or int(others[0, 0]) == 0:
        return None
    leading = int(others[0, 0])
    if bool((ids[leading:, 0] == time).any()):  # generated tokens after a reference's: not one leading grid
        return None
    return grid_from_ids(ids[:leading], leading)
