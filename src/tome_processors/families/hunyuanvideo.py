"""HunyuanVideo (and 1.5): double-stream (then single-stream) blocks over a `(frames, h, w)` grid of video tokens and
the text."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from ..arguments import argument
from .base import Family, Layout, Rotary, Stack
from .wan import WanFamily

#: Both kinds of block call their attention with the video tokens as `hidden_states` and the text as
#: `encoder_hidden_states`; the processor attends over the video then the text and returns `(video, text)`.
_STACKS = (
    Stack("transformer_blocks", Layout.JOINT_IMAGE_FIRST, feed_forward="ff", built_with=HunyuanVideoAttnProcessor2_0),
    Stack("single_transformer_blocks", Layout.JOINT_IMAGE_FIRST, built_with=HunyuanVideoAttnProcessor2_0),
)


class HunyuanVideoFamily(Family):
    """`HunyuanVideoTransformer3DModel` (HunyuanVideo, text- and image-to-video): its double-stream blocks
    (`transformer_blocks`) and single-stream blocks (`single_transformer_blocks`).

    Every block gets the video tokens and the text apart (the single-stream block concatenates them for its
    MLP, but calls its attention with the two apart), so only the video tokens are merged, inside attention;
    the text is never merged. The token refiner (`context_embedder`) attends over the text alone and is left
    as it is. Rotary tables `(cos, sin)`, each `(N_video, D)`, cover the video tokens alone (the processor
    rotates the video part of the sequence): a merged row keeps the rotation of the token it is kept at. The
    model's attention mask covers the video then the text, the text's padding masked: it is cut to the merged
    sequence. The grid is the latent `(B, C, F, H, W)` over `patch_size_t` and `patch_size`; the pipeline
    passes the timestep on the 0..1000 scale. `merge_mlp` merges the double-stream blocks' feed-forward (`ff`);
    the single-stream blocks' MLP runs on the video and text together and is not merged.
    """

    guidance_in_batch = False  # called once per guidance branch, at batch 1

    name = "hunyuanvideo"
    model_class = HunyuanVideoTransformer3DModel
    stacks = _STACKS
    video = True
    needs_row_token = True
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=False, text_table=False)
    masks_text_only = True  # the model's own mask: ones over the video, then the prompt's padding
    timestep_position = 1
    merge_only = True  # joint attention computes keys and values inside the processor
    # Wan's presets (docs/video.md): both are video transformers whose attention sees every frame's tokens
    # with 3-D rotary positions; measured on the trained Wan-shaped video model, not on HunyuanVideo itself.
    defaults: dict[str, Any] = dict(WanFamily.defaults)
    presets: dict[str, dict[str, Any]] = WanFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            return None
        p, p_t = int(model.config.patch_size), int(model.config.patch_size_t)
        return int(x.shape[2]) // p_t, int(x.shape[3]) // p, int(x.shape[4]) // p


class HunyuanVideo15Family(HunyuanVideoFamily):
    """`HunyuanVideo15Transformer3DModel` (HunyuanVideo 1.5, text- and image-to-video): its double-stream blocks.

    As HunyuanVideo's double-stream blocks: the video tokens merge inside attention, the text (the Qwen, ByT5
    and image-embedding tokens, reordered per sample) never; the token refiner is left as it is. The mask the
    blocks pass covers the text alone and the processor pads it over the video tokens itself, so it fits any
    number of merged rows and is passed as it is. The latent (the noisy latent, the condition and its mask
    concatenated over channels) gives the grid over `patch_size_t` and `patch_size` (1 in the released models).
    """

    name = "hunyuanvideo15"
    vae_scale_factor = 16
    model_class = HunyuanVideo15Transformer3DModel
    stacks = (
        Stack(
            "transformer_blocks", Layout.JOINT_IMAGE_FIRST, feed_forward="ff", built_with=HunyuanVideo15AttnProcessor2_0
        ),
    )
