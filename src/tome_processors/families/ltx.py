"""LTX-Video: a video diffusion transformer over packed `(frames, h, w)` tokens, 3-D rotary positions per sample."""

from __future__ import annotations

import torch
from diffusers import LTXVideoTransformer3DModel

from ..arguments import argument
from .base import Rotary
from .wan import WanFamily


class LTXVideoFamily(WanFamily):
    """`LTXVideoTransformer3DModel` (LTX-Video 0.9.x): `LTXVideoTransformerBlock`s over packed video tokens.

    Each block's `attn1` is self-attention over the video tokens with 3-D rotary embeddings, `(cos, sin)`
    of shape `(B, N, D)` as `image_rotary_emb` (a merged row keeps the rotation of the token it is kept at);
    `attn2` is cross-attention to the text, whose keys and values are never merged; `ff` is the
    feed-forward (`merge_mlp`). The model gets the tokens packed, `(B, F * H * W, C)` in frame, row, column
    order, and the grid as `num_frames`, `height`, `width` (Python ints, so a compiled graph holds them).
    The pipelines pass the timestep on the 0..1000 scale.
    """

    guidance_in_batch = True  # its pipeline batches the guidance halves

    # Wan's blocks (self-attention with rotary rows, cross-attention, feed-forward), K/V pooling refused for
    # the same reason, and Wan's presets (docs/video.md): both are video transformers whose self-attention
    # sees every frame's tokens with 3-D rotary positions; measured on the trained Wan-shaped video model.
    name = "ltx"
    vae_scale_factor = 32
    frames_per_latent = 8
    model_class = LTXVideoTransformer3DModel
    block_list = "transformer_blocks"
    feed_forward = "ff"
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=False, batched=True)
    timestep_position = 2

    #: Where the forward takes the latent grid: `num_frames`, `height`, `width` (after hidden_states, text,
    #: timestep and mask), divided by the config's `patch_size_t` / `patch_size` (1 on LTX-Video).
    grid_arguments: tuple[tuple[int, str], ...] = ((4, "num_frames"), (5, "height"), (6, "width"))

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        grid = [argument(args, kwargs, position, name) for position, name in self.grid_arguments]
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or not all(isinstance(v, int) and v > 0 for v in grid):
            return None
        p_t, p = int(getattr(model.config, "patch_size_t", 1)), int(getattr(model.config, "patch_size", 1))
        frames, h, w = grid[0] // p_t, grid[1] // p, grid[2] // p
        return (frames, h, w) if frames * h * w == x.shape[1] else None
