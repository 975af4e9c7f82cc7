"""Kandinsky 5 and Kandinsky 6: diffusion transformers over a `(frames, h, w)` grid of patch tokens of channels-last
latents `(B, T, H, W, C)`, with 3-D rotary self-attention over the video (or the one frame of an image) and
cross-attention to the text; and Kandinsky 6's super-resolution transformer, refused with the reason (`REFUSED`:
its attention is block-sparse)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Kandinsky5Transformer3DModel, Kandinsky6SRTransformer3DModel, Kandinsky6Transformer3DModel

from ..arguments import argument
from .base import AttentionSite, BlockSite, Family, Layout, Rotary
from .wan import WanFamily


def _grid_of_latent(model: torch.nn.Module, x: Any) -> tuple[int, int, int] | None:
    """`(frames, h, w)` tokens of a channels-last latent `(B, T, H, W, C)` over `config.patch_size`."""
    if not isinstance(x, torch.Tensor) or x.ndim != 5:
        return None
    p_t, p_h, p_w = model.config.patch_size
    return int(x.shape[1]) // p_t, int(x.shape[2]) // p_h, int(x.shape[3]) // p_w


class KandinskyFamily(Family):
    """What Kandinsky 5's and Kandinsky 6's transformers share: a video family over the channels-last latent's
    `(T, H, W)` grid over `config.patch_size` (`(1, 2, 2)` released), with 3-D rotary self-attention whose processor
    gets one tensor of 2x2 rotation matrices per token and channel pair (`Rotary(pair=False)`: a merged row keeps
    the rotation of the token it is kept at, as on Wan), cross-attention to the text and a feed-forward per block.
    The subclasses say where the blocks are and how the tables come."""

    video = True
    needs_row_token = True
    guidance_in_batch = False  # the pipelines call the model once per guidance branch
    # The processor rotates the keys with a table of one row per token: pooled keys cannot pass through it.
    merge_only = True
    vae_scale_factor = 8  # HunyuanVideo's VAE (video), FLUX.1's (Kandinsky 5's images)
    frames_per_latent = 4
    defaults: dict[str, Any] = {"ratio": 0.5}
    # Borrowed from WanFamily.presets (video, 3-D rotary self-attention and text cross-attention); not measured on
    # these models. One frame (Kandinsky 5's image pipelines) merges frame by frame whatever `st` says.
    presets: dict[str, dict[str, Any]] = WanFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        return _grid_of_latent(model, argument(args, kwargs, self.input_position, self.input_name))


class Kandinsky5Family(KandinskyFamily):
    """`Kandinsky5Transformer3DModel` (Kandinsky 5.0 text- and image-to-video, Lite and Pro; text-to-image and image
    editing, which call it with one frame): `Kandinsky5TransformerDecoderBlock`s in `visual_transformer_blocks`.

    Each block's `self_attention` attends over the video tokens, rotated by the model's 3-D rotary table, passed as
    `rotary_emb`: `(B, N, 1, D/2, 2, 2)`, one per sample (`Rotary(pair=False, batched=True)`). `cross_attention`
    attends from the video tokens to the text (`merge_crossattn`), `feed_forward` is merged with `merge_mlp`. The
    text blocks (`text_transformer_blocks`, 1-D rotary over the text alone) are never wrapped.

    NABLA: a model configured with `attention_type="nabla"` (as the original code configures Lite's 10 s models and
    Video Pro) gets
    `sparse_params` from its pipelines (`get_sparse_params`). Its forward then reorders the video tokens into 8x8
    blocks (`fractal_flatten`), and its processor builds a block mask over runs of 64 consecutive tokens of the
    whole sequence (`nablaT_v2`, with the pipeline's STA mask sized for the whole grid): merged tokens would line up
    with neither. `check_config` refuses such a model at apply time; a forward given `sparse_params` anyway gives
    no token grid, so nothing merges and each attention says so once (`Skip.NO_MODEL_GRID`).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["kandinsky5"]().preset_options("balanced")["st"]
        2
    """

    name = "kandinsky5"
    model_class = Kandinsky5Transformer3DModel
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...): the scheduler's 0..1000
    rotary = Rotary(name="rotary_emb", position=1, batched=True, pair=False)

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """Each visual block's self-attention (rotary rows), cross-attention to the text and feed-forward."""
        return [
            _block_site(block, block.self_attention, block.cross_attention, block.feed_forward)
            for block in model.visual_transformer_blocks
        ]

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        if argument(args, kwargs, 7, "sparse_params") is not None:
            return None  # NABLA: the tokens come in 8x8 blocks and attend through a block mask (class doc)
        return super().token_grid(model, args, kwargs)

    def check_config(self, model: torch.nn.Module, config: Any) -> None:
        if getattr(model.config, "attention_type", None) == "nabla":
            raise ValueError(
                f"Expected a {type(model).__name__} with regular attention, but got attention_type='nabla': its "
                "pipelines pass sparse_params, its forward reorders the video tokens into 8x8 blocks and its "
                "self-attention builds a block-sparse mask over runs of 64 of them (NABLA), which merged tokens "
                "would no longer line up with. ToMe cannot merge in this model."
            )
        super().check_config(model, config)


class Kandinsky6Family(KandinskyFamily):
    """`Kandinsky6Transformer3DModel` (Kandinsky 6.0 text- and image-to-video-and-audio): fused video and audio
    blocks, `Kandinsky6FusedTransformerDecoderBlock`, in `visual_transformer_blocks`.

    Only each block's video stream is declared: `video_dec_block.self_attention` (3-D rotary rows, one tensor
    `(N, 1, D/2, 2, 2)` for the batch, passed as `rotary_emb` and again, the same table, as the keys'
    `rotary_emb_kv`: both follow the merged rows), `video_dec_block.cross_attention` (video to text; its text padding
    mask, `attn_mask` over the keys alone, lines up with merged queries) and `video_dec_block.feed_forward`. The
    block's first input is the video tokens, the merge metric. The audio stream's attention and the video-audio
    cross-attentions (`va_cross_attention`, `av_cross_attention`) are never wrapped: they run on every token. The
    grid is the latent's, the image-to-video reference frame (appended as one more frame) included. Kandinsky 6 has
    no block-sparse attention (its super-resolution model has, and is refused: `REFUSED`).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["kandinsky6"]().rotary.key_name
        'rotary_emb_kv'
    """

    name = "kandinsky6"
    model_class = Kandinsky6Transformer3DModel
    timestep_position = 3  # forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, ...)
    rotary = Rotary(name="rotary_emb", position=1, pair=False, key_name="rotary_emb_kv", key_position=2)

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """Each fused block's video self-attention, video-to-text cross-attention and video feed-forward."""
        sites = []
        for block in model.visual_transformer_blocks:
            video = block.video_dec_block
            sites.append(_block_site(block, video.self_attention, video.cross_attention, video.feed_forward))
        return sites


#: The model classes of this module ToMe refuses, each with why (`families.family_of` raises it). Kandinsky 6.0's
#: super-resolution transformer: its only attention is block-sparse, always. Its forward reorders the tokens into 8x8
#: blocks (`_local_patch` in transformer_kandinsky6_sr.py) and every block's self-attention builds a NABLA block mask
#: over runs of 64 of them (`nabla_block_mask`, with a sliding-tile prior sized for the whole grid) on the flex
#: backend; merged tokens would line up with neither.
REFUSED: dict[type, str] = {
    Kandinsky6SRTransformer3DModel: (
        "Expected a model whose attention ToMe can merge, but got Kandinsky6SRTransformer3DModel: its forward "
        "reorders the tokens into 8x8 blocks and every self-attention is NABLA block-sparse attention over runs of 64 "
        "of them (a block mask on the flex backend), which merged tokens would no longer line up with. ToMe cannot "
        "merge in this model."
    )
}


def _block_site(
    block: torch.nn.Module, self_attention: torch.nn.Module, cross_attention: torch.nn.Module, feed_forward: Any
) -> BlockSite:
    attentions = (AttentionSite(self_attention, False, Layout.ROTARY), AttentionSite(cross_attention, True))
    return BlockSite(block, attentions, feed_forward)
