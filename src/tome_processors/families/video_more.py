"""More video transformers: Cosmos, MiniMax-H3, Allegro, EasyAnimate, Latte and Mochi; Cosmos 3 refused.

By how their attention gets the video's tokens:

- Wan-like, the tokens of the whole clip in self-attention with a rotary row each, cross-attention to the text:
  Cosmos (`CosmosTransformer3DModel`: Cosmos 1.0, Predict 2 and 2.5) and Allegro (`AllegroTransformer3DModel`);
- joint, text then video in one attention, the rotary tables over the video alone: EasyAnimate
  (`EasyAnimateTransformer3DModel`); video then text: Mochi (`MochiTransformer3DModel`);
- one packed sequence of text, references, audio then the generated video: MiniMax-H3 (`MiniMaxH3Transformer3DModel`);
- PixArt-like blocks over one frame at a time, the frames in the batch: Latte's spatial blocks
  (`LatteTransformer3DModel`).

`REFUSED` says why Cosmos 3 (`Cosmos3OmniTransformer`) cannot merge.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch
from diffusers import (
    AllegroTransformer3DModel,
    Cosmos3OmniTransformer,
    CosmosTransformer3DModel,
    EasyAnimateTransformer3DModel,
    LatteTransformer3DModel,
    MiniMaxH3Transformer3DModel,
    MochiTransformer3DModel,
)
from diffusers.models.attention_processor import AllegroAttnProcessor2_0, MochiAttnProcessor2_0
from diffusers.models.transformers.transformer_cosmos import (
    CosmosAttention,
    CosmosAttnProcessor2_0,
    CosmosAttnProcessor2_5,
)
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateAttnProcessor2_0

from .._similarity import is_compiling
from ..arguments import argument
from .base import AttentionSite, BlockSite, Family, Layout, Rotary, Span, Stack
from .dit import PixArtFamily
from .wan import WanFamily


class LatentVideoFamily(Family):
    """A video transformer whose input is the `(B, C, F, H, W)` latent, patched into frame-major tokens.

    Its grid is `(F / p_t, H / p_h, W / p_w)` over the latent pixels per token (`patches`). Its attention rotates
    every video token with a rotary row of its own (a merged row keeps its kept token's), so K/V pooling cannot be
    passed in: `merge_only`.
    """

    video = True
    needs_row_token = True
    merge_only = True
    frames_per_latent = 4
    defaults: dict[str, Any] = dict(WanFamily.defaults)
    # Borrowed from WanFamily.presets (video transformers whose self-attention sees every frame's tokens with 3-D
    # rotary positions); not measured on these models.
    presets: dict[str, dict[str, Any]] = WanFamily.presets

    def patches(self, model: torch.nn.Module) -> tuple[int, int, int]:
        """Latent frames, rows and columns per token: `config.patch_size` as a triple, or one frame of a square."""
        patch = model.config.patch_size
        return tuple(patch) if isinstance(patch, (tuple, list)) else (1, patch, patch)

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            return None
        p_t, p_h, p_w = self.patches(model)
        return int(x.shape[2]) // p_t, int(x.shape[3]) // p_h, int(x.shape[4]) // p_w


class CosmosFamily(LatentVideoFamily):
    """`CosmosTransformer3DModel` (Cosmos 1.0, Cosmos Predict 2 and 2.5, Transfer 2.5): `CosmosTransformerBlock`s.

    Each block's `attn1` is self-attention over the video's tokens alone, rotated with `(cos, sin)` tables of one row
    per token, `(N, D)`, for the whole batch (`Layout.IMAGE_FIRST` with no other tokens: each row rotated at its kept
    token's position); `attn2` is cross-attention to the text (and Transfer 2.5's image context), never merged by
    default. The timestep is 0..1 (Predict 2.5 passes sigma, Predict 2 `sigma / (sigma + 1)`), one per sample or
    per latent frame `(B, 1, T, 1, 1)` where conditioning frames hold a clean one: `timestep()` takes each sample's
    noisiest. Cosmos 1.0's pipelines pass EDM's `log(sigma) / 4` instead, which no scale makes 0..1000: there
    `ratio_start` reads it as it is.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["cosmos"]().rotary.name
        'image_rotary_emb'
    """

    guidance_in_batch = False  # the Predict pipelines call the model once per guidance branch

    name = "cosmos"
    model_class = CosmosTransformer3DModel
    built_with = CosmosAttnProcessor2_0
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=True)
    timestep_position = 1

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """Each block's self-attention (`attn1`) and cross-attention (`attn2`: Transfer 2.5's `CosmosAttention` is built
        with `CosmosAttnProcessor2_5`)."""
        sites = []
        for block in model.transformer_blocks:
            cross = CosmosAttnProcessor2_5 if isinstance(block.attn2, CosmosAttention) else None
            attentions = (
                AttentionSite(block.attn1, False, Layout.IMAGE_FIRST),
                AttentionSite(block.attn2, True, built_with=cross),
            )
            sites.append(BlockSite(block, attentions, block.ff))
        return sites

    def timestep(self, args: tuple, kwargs: dict) -> object:
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
        if isinstance(t, torch.Tensor) and t.ndim == 5:  # one per latent frame: the generated frames'
            t = t.flatten(1).amax(dim=1)
        return t * 1000.0 if t is not None else None


class AllegroFamily(LatentVideoFamily):
    """`AllegroTransformer3DModel` (Allegro): PixArt-like blocks over the whole clip's tokens.

    Each block's `attn1` is self-attention over the video's tokens (`Layout.ROTARY`), rotated per axis: its processor
    gets `((t, h, w) tables, (t, h, w) positions)`, each token's row in the tables (`Rotary(indexed=True)`: a merged row
    is rotated at its kept token's positions); `attn2` is cross-attention to the text. Its patch embedding patches
    each latent frame on its own (one token per frame and `patch_size` square), its pipeline passes the scheduler's
    0..1000 timestep and batches the guidance halves.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["allegro"]().rotary.indexed
        True
    """

    guidance_in_batch = True  # its pipeline batches the guidance halves

    name = "allegro"
    model_class = AllegroTransformer3DModel
    built_with = AllegroAttnProcessor2_0
    rotary = Rotary(name="image_rotary_emb", position=3, indexed=True)  # (encoder_hidden_states, mask, temb, rotary)
    timestep_position = 2

    def patches(self, model: torch.nn.Module) -> tuple[int, int, int]:
        return 1, model.config.patch_size, model.config.patch_size

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """Each block's self-attention (`attn1`, rotated per axis) and cross-attention (`attn2`)."""
        return [
            BlockSite(
                block,
                (AttentionSite(block.attn1, False, Layout.ROTARY), AttentionSite(block.attn2, True)),
                block.ff,
            )
            for block in model.transformer_blocks
        ]


class EasyAnimateFamily(LatentVideoFamily):
    """`EasyAnimateTransformer3DModel` (EasyAnimate V5.1): MMDiT blocks over the text and the video's tokens.

    Each block's `attn1` is joint attention (`Layout.JOINT`): the video as `hidden_states`, the text as
    `encoder_hidden_states`, which its processor puts first; its rotary tables `(cos, sin)` cover the video alone
    (`Rotary(covers_text=False, text_table=False)`). Blocks past `mmdit_layers` have no text projections of their own
    and concatenate the text in the processor all the same. The grid is the latent's frames over the model's square
    `patch_size`; its pipeline passes the flow-matching scheduler's 0..1000 timestep and batches the guidance halves.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["easyanimate"]().rotary.covers_text
        False
    """

    guidance_in_batch = True  # its pipelines batch the guidance halves

    name = "easyanimate"
    model_class = EasyAnimateTransformer3DModel
    built_with = EasyAnimateAttnProcessor2_0
    stacks = (Stack("transformer_blocks", Layout.JOINT, attention="attn1", feed_forward="ff"),)
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=False, text_table=False)
    timestep_position = 1


class MochiFamily(LatentVideoFamily):
    """`MochiTransformer3DModel` (Mochi 1): asymmetric MMDiT blocks over the video's tokens and the text.

    Each block's `attn1` (`MochiAttention`, a plain module that calls its `processor` attribute) gets the video as
    `hidden_states` and the text as `encoder_hidden_states`, projects them apart, rotates the video's queries and keys
    alone with `(cos, sin)` tables of `(N_video, heads, D/2)` for the whole batch, then attends per sample over the
    video followed by that sample's valid text tokens, and returns `(video, text)`: `Layout.JOINT_IMAGE_FIRST`, the
    tables over the video alone (`Rotary(covers_text=False, text_table=False)`: a merged row is rotated at its kept
    token's position). Its mask, `(B, L_text)`, covers the text alone (the processor picks each sample's valid text
    tokens itself), so it fits any number of merged rows and passes as it is (`masks_text_only`). The last block's
    attention keeps no text output (`context_pre_only`); its video tokens merge all the same. `merge_mlp` merges the
    video's feed-forward (`ff`); the text's (`ff_context`) is never merged.

    The grid is the latent `(B, C, F, H, W)`'s frames over a square `patch_size`. Its pipeline batches the guidance
    halves and passes `1000 (1 - sigma)` (its scheduler's `invert_sigmas`: 0 is pure noise), so `timestep()` gives
    `1000 - t`. Its VAE is 8 pixels a latent pixel and 6 frames a latent frame after the first.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> float(FAMILIES["mochi"]().timestep((None, None, torch.tensor(250.0)), {}))
        750.0
    """

    guidance_in_batch = True  # its pipeline batches the guidance halves

    name = "mochi"
    model_class = MochiTransformer3DModel
    stacks = (
        Stack(
            "transformer_blocks",
            Layout.JOINT_IMAGE_FIRST,
            attention="attn1",
            feed_forward="ff",
            built_with=MochiAttnProcessor2_0,
        ),
    )
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=False, text_table=False)
    masks_text_only = True  # `(B, L_text)`: the text's padding alone
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, encoder_attention_mask)
    frames_per_latent = 6  # `MochiPipeline.vae_temporal_scale_factor`
    # `defaults` and `presets`: LatentVideoFamily's, borrowed from WanFamily; not measured on Mochi.

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The noise level on the 0..1000 scale: `1000 - t` (the pipeline passes `1000 (1 - sigma)`)."""
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
        return 1000.0 - t if t is not None else None


class LatteFamily(PixArtFamily):
    """`LatteTransformer3DModel` (Latte): spatial blocks, PixArt-α's `BasicTransformerBlock`s, each followed by a
    temporal one.

    The spatial blocks (`transformer_blocks`) get one frame's tokens per row of the batch, `(B x F, h x w, C)`: their
    self-attention merges each frame's `(h, w)` grid on its own, as PixArt's (its `blocks()`), and their
    cross-attention attends to the text. The temporal blocks (`temporal_transformer_blocks`) attend over the frames at
    each position, `(B x h x w, F, C)`, which form no grid: they are not declared, so never merged. The grid is the
    latent's `(H, W)` over `patch_size`; the frames count as samples (an image family: `st` stays 1).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["latte"]().video
        False
    """

    name = "latte"
    model_class = LatteTransformer3DModel
    timestep_position = 1
    # PixArt's presets (its spatial blocks are PixArt-α's, over one frame's grid); not measured on Latte.

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            return None
        patch = int(model.config.patch_size)
        return int(x.shape[3]) // patch, int(x.shape[4]) // patch


#: MiniMax-H3's modality tag of a video row (`token_tags`): 0 video, 1 text, 2 audio.
MINIMAX_H3_VIDEO_TAG = 0


class MiniMaxH3Family(Family):
    """`MiniMaxH3Transformer3DModel` (MiniMax-H3: video with audio): one stack of blocks over one packed sequence.

    Its pipelines pack text, the keyframes' or references' rows, the audio, then the generated video's rows, frame by
    frame, into one sequence (`[text | conditions | audio | video]`), so each block's input holds the video's tokens
    last (`Span.TRAILING`). Each block's `attn` is full self-attention over the sequence (`Layout.TEXT_FIRST`: every
    token ahead of the video's a row of its own), rotated with `(cos, sin)` tables of one row per token of the
    sequence, passed right after `hidden_states` (`Rotary(position=0)`). The model's input is the video rows alone,
    flattened: the grid is read from the rows the forward's `token_tags` tag as video after the last other row, and
    their `(t, h, w)` `position_ids` (read on the host once per `position_ids` tensor, as Flux's `img_ids`). The
    timestep is the video rows' `t = 1 - sigma` (1 is clean): `timestep()` takes the last row's.

    Under diffusers' context parallelism (its `_cp_plan` splits the packed sequence at the first block) the ranks hold
    unequal shares of the video's tokens, the first rank's behind the text and audio (`leading_tokens`): every rank
    merges as many of its last video tokens as the first rank holds (`parallel.local_grid`). The token refiner's blocks
    attend over the text alone and are not declared.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["minimax_h3"]().rotary.position
        0
    """

    guidance_in_batch = False  # guidance-distilled: one call per step, batch 1

    name = "minimax_h3"
    model_class = MiniMaxH3Transformer3DModel
    video = True
    needs_row_token = True
    merge_only = True
    rotary = Rotary(name="rotary_emb", position=0, covers_text=True)
    # forward(hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices, token_tags,
    # position_ids, ...)
    timestep_position = 3
    # Each block's attention over the packed sequence; its metric the video's tokens (every frame's), last.
    stacks = (Stack("transformer_blocks", Layout.TEXT_FIRST, feed_forward="ff", span=Span.TRAILING),)
    vae_scale_factor = 16
    #: Its video VAE encodes chunks of 17 pixel frames into 5 latent frames (`latent_frames`).
    frames_per_chunk, latents_per_chunk = 17, 5
    defaults: dict[str, Any] = dict(WanFamily.defaults)
    # Borrowed from WanFamily.presets (a video transformer whose self-attention sees every frame's tokens with 3-D
    # rotary positions); not measured on this model.
    presets: dict[str, dict[str, Any]] = WanFamily.presets

    def __init__(self) -> None:
        self._last: tuple[weakref.ref, weakref.ref, object, int, tuple[int, int, int] | None] | None = None
        self._warned = False

    def __getstate__(self) -> dict:  # a copy reads its position ids afresh (the last read holds weak references)
        return {**vars(self), "_last": None}

    def latent_frames(self, num_frames: int, stride: int | None = None) -> int:
        """Latent frames of a clip of `num_frames` pixel frames, snapped up to `17 n + 5` as its pipelines do: 5 latent
        frames per 17 pixel frames, and 2 more.

        Example:
            >>> from tome_processors.families import FAMILIES
            >>> FAMILIES["minimax_h3"]().latent_frames(124), FAMILIES["minimax_h3"]().latent_frames(120)
            (37, 37)
        """
        chunk, latents = self.frames_per_chunk, self.latents_per_chunk
        frames = max(num_frames, latents)
        frames += (latents - frames) % chunk
        return (frames - latents) // chunk * latents + 2

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The video rows' noise on the 0..1000 scale: `1 - t` of the packed sequence's last row (a generated video
        row), from the forward's distinct timesteps and each row's index into them."""
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
        rows = argument(args, kwargs, 4, "timestep_indices")
        if not isinstance(t, torch.Tensor) or not isinstance(rows, torch.Tensor) or rows.numel() == 0:
            return None
        return (1.0 - t.index_select(0, rows[-1:])) * 1000.0

    def leading_tokens(self, args: tuple, kwargs: dict, grid: tuple[int, ...]) -> int | None:
        """The packed sequence's rows ahead of the generated video's: text, conditions and audio."""
        tags = argument(args, kwargs, 5, "token_tags")
        if not isinstance(tags, torch.Tensor) or tags.ndim != 1:
            return None
        return int(tags.shape[0]) - math.prod(grid)

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        tags = argument(args, kwargs, 5, "token_tags")
        positions = argument(args, kwargs, 6, "position_ids")
        if not all(isinstance(t, torch.Tensor) for t in (x, tags, positions)) or x.ndim != 3:
            return None
        if is_compiling():  # reading the ids is a host sync that a graph cannot hold: outside it (a graph break)
            return _read_grid_outside_the_graph(self, model, tags, positions, int(x.shape[1]))
        return self._read_grid(model, tags, positions, int(x.shape[1]))

    def _read_grid(
        self, model: torch.nn.Module, tags: torch.Tensor, positions: torch.Tensor, video_rows: int
    ) -> tuple[int, int, int] | None:
        last = self._last
        # The pipelines pass the same layout tensors every step: read once. Inference tensors keep no version.
        version = (-1, positions.data_ptr()) if positions.is_inference() else positions._version
        if last is not None and last[0]() is positions and last[1]() is tags and last[2:4] == (version, video_rows):
            return last[4]
        grid = video_grid(tags, positions, video_rows)
        self._last = (weakref.ref(positions), weakref.ref(tags), version, video_rows, grid)
        if grid is None and not self._warned:
            self._warned = True
            warnings.warn(
                f"ToMe merges nothing in this {type(model).__name__} call: expected the packed sequence to close with "
                f"the generated video's rows (tagged {MINIMAX_H3_VIDEO_TAG} in token_tags), frame by frame and row by "
                "row in position_ids, but got a layout whose last rows form no such grid.",
                UserWarning,
                stacklevel=2,
            )
        return grid


@torch.compiler.disable
def _read_grid_outside_the_graph(
    family: MiniMaxH3Family, model: torch.nn.Module, tags: torch.Tensor, positions: torch.Tensor, video_rows: int
) -> tuple[int, int, int] | None:
    return family._read_grid(model, tags, positions, int(video_rows))


def video_grid(tags: torch.Tensor, positions: torch.Tensor, video_rows: int) -> tuple[int, int, int] | None:
    """`(frames, h, w)` of the generated video that closes MiniMax-H3's packed sequence, or None where its last rows
    form no such grid.

    The video's rows are those `tags` (`(S,)`) tags as video after the last row of another modality, at most
    `video_rows` (the model's video input, conditioning rows first); `positions` (`(S, 3)`, `(t, h, w)`) hold one time
    per frame, rising frame by frame, and in every frame the same rows of `h` rising down the rows and `w` rising
    along them. A host read of both.

    Example:
        >>> t, h, w = torch.meshgrid(torch.arange(2.0), torch.arange(3.0), torch.arange(4.0), indexing="ij")
        >>> grid = torch.stack([t, h, w], -1).view(-1, 3)
        >>> positions = torch.cat([torch.zeros(5, 3), grid])
        >>> tags = torch.tensor([1] * 3 + [2] * 2 + [0] * 24)
        >>> video_grid(tags, positions, 24), video_grid(tags, positions.flip(0), 24)
        ((2, 3, 4), None)
    """
    if tags.ndim != 1 or positions.ndim != 2 or positions.shape != (tags.shape[0], 3) or tags.numel() == 0:
        return None
    tags, positions = tags.cpu(), positions.detach().cpu().double()
    others = torch.nonzero(tags != MINIMAX_H3_VIDEO_TAG)
    start = int(others[-1, 0]) + 1 if others.numel() else 0
    rows = positions[start:]
    count = int(rows.shape[0])
    if count == 0 or count > video_rows:
        return None
    t, h, w = rows.unbind(1)
    per_frame = _trailing_run(t)  # the last frame's rows: one time
    per_row = _trailing_run(h[-per_frame:])  # its last row's tokens: one h
    if count % per_frame or per_frame % per_row:
        return None
    frames, height, width = count // per_frame, per_frame // per_row, per_row
    t, h, w = (axis.reshape(frames, height, width) for axis in (t, h, w))
    ordered = (
        bool((t == t[:, :1, :1]).all())
        and bool((t[1:, 0, 0] > t[:-1, 0, 0]).all())
        and bool((h == h[:1]).all() and (w == w[:1]).all())
        and bool((h == h[:, :, :1]).all() and (h[0, 1:, 0] > h[0, :-1, 0]).all())
        and bool((w == w[:, :1]).all() and (w[0, 0, 1:] > w[0, 0, :-1]).all())
    )
    return (frames, height, width) if ordered else None


def _trailing_run(values: torch.Tensor) -> int:
    """How many of `values`' last entries equal its last one.

    Example:
        >>> _trailing_run(torch.tensor([1.0, 2.0, 2.0])), _trailing_run(torch.tensor([2.0, 2.0]))
        (2, 2)
    """
    differ = torch.nonzero(values != values[-1])
    return int(values.shape[0]) - (int(differ[-1, 0]) + 1 if differ.numel() else 0)


#: Model classes whose attention ToMe cannot merge, each with why (`families.REFUSED`).
REFUSED: dict[type, str] = {
    Cosmos3OmniTransformer: (
        "Expected a model whose attention ToMe can merge, but got Cosmos3OmniTransformer: its decoder layers take the "
        "text (understanding) stream first and the video, sound and action tokens second, each as one packed (tokens, "
        "channels) sequence without a batch axis, and its attention gets both with four rotary tables "
        "(Cosmos3PackedMoTAttention, transformer_cosmos3.py). ToMe reads a block's first input as its image tokens and "
        "merges (batch, tokens, channels) tensors: ToMe cannot reach the video's tokens there."
    ),
}
