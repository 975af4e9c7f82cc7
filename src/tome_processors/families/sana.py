"""Sana and Sana-Video: diffusion transformers whose self-attention is linear attention (ReLU kernels, no softmax over
the tokens), followed by cross-attention to the text and a Mix-FFN; and Sana-WM with its refiner, refused with the
reason (`REFUSED`).

A Sana block runs `attn1` (linear self-attention over the image or video tokens), `attn2` (cross-attention from those
tokens to the text) and `ff`, a Mix-FFN (`GLUMBConv`, Sana-Video's `GLUMBTempConv`): 1x1 convolutions around a
depthwise 3x3 convolution over the token grid (and, on Sana-Video, a convolution along time), so it needs every token
of the grid in its place. ToMe merges the tokens entering the self-attention only: fewer rows for its four
projections and for its key-value sums, unmerged before the residual. The feed-forward is never declared, so
`merge_mlp` cannot reach it.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    SanaTransformer2DModel,
    SanaVideoTransformer3DModel,
    SanaWMLTX2RefinerTransformer3DModel,
    SanaWMTransformer3DModel,
)
from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
from diffusers.models.transformers.sana_transformer import SanaAttnProcessor2_0
from diffusers.models.transformers.transformer_sana_video import SanaAttnProcessor2_0 as SanaVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_sana_video import SanaLinearAttnProcessor3_0

from ..arguments import argument
from .base import AttentionSite, BlockSite, Family, Layout
from .dit import _DIT_PRESETS
from .wan import WanFamily


class SanaFamily(Family):
    """`SanaTransformer2DModel` (Sana 0.6B / 1.6B, Sana 1.5, Sana-Sprint; SanaPipeline, its ControlNet, PAG and Sprint
    pipelines): `SanaTransformerBlock`s in `transformer_blocks` over the DC-AE latent's grid (32 px a latent pixel,
    patch 1 in the released models: 1024 tokens at 1024 px).

    Each block's `attn1` is linear self-attention over the image tokens (`Layout.IMAGE`, built with
    `SanaLinearAttnProcessor2_0`; no mask, no positions); `attn2` is cross-attention to the text
    (`SanaAttnProcessor2_0`; its queries merge with `merge_crossattn`, its padding mask covers the text keys alone).
    The Mix-FFN is left whole (module doc). K/V pooling (`mode="downsample_kv"`) passes the pooled tokens as the
    processor's `encoder_hidden_states`, which it takes the keys and values from.

    The timestep: SanaPipeline passes the scheduler's 0..1000 (times `config.timestep_scale`, 1 in the released
    models); Sana-Sprint's pipelines pass TrigFlow's time mapped to 0..1 (`sin t / (sin t + cos t)`), and they alone
    pass `guidance` (Sprint's models embed it): such a timestep is scaled by 1000 (`timestep()`).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["sana"]().timestep((None, None, torch.tensor([0.5]), torch.tensor([4.5])), {}).tolist()
        [500.0]
    """

    name = "sana"
    model_class: type = SanaTransformer2DModel
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, guidance, ...)
    vae_scale_factor = 32  # DC-AE f32c32
    #: The attention processors the model builds each block's `attn1` and `attn2` with.
    self_processor: type = SanaLinearAttnProcessor2_0
    cross_processor: type = SanaAttnProcessor2_0
    self_layout = Layout.IMAGE
    # Borrowed from PixArtFamily (`_DIT_PRESETS`: a cross-attention DiT of the same shape, called alike); not
    # measured for quality on this model. Merging the linear self-attention alone can save at most its share of a
    # block's work (its four projections: about 28% at 1024 px, so at most 1.13x / 1.16x / 1.25x at ratio 0.4 / 0.5 /
    # 0.7); measured on this 2-core CPU, one block at Sana 1.6B's width, 1024 px (1024 tokens), batch 2
    # (`tome-processors bench --arch sana --layers 1 --resolution 1024 --rounds 5 --presets balanced fast --ratios
    # 0.5`, twice, load average 2-5 and 6-7): balanced 1.05x / 1.08x, fast 1.27x / 1.23x, ratio 0.5 1.22x / 1.17x
    # (medians). It pays, so the presets merge where pays.py's rule says (here: on the CPU from 1e8 work per block;
    # on a GPU nothing at 1024 px, below its 9e10).
    defaults: dict[str, Any] = {"ratio": 0.4}
    presets = _DIT_PRESETS

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """Each block's linear self-attention and, where the block has one, its cross-attention (no feed-forward)."""
        sites = []
        for block in model.transformer_blocks:
            attentions = [AttentionSite(block.attn1, False, self.self_layout, self.self_processor)]
            if getattr(block, "attn2", None) is not None:
                attentions.append(AttentionSite(block.attn2, True, Layout.IMAGE, self.cross_processor))
            sites.append(BlockSite(block, tuple(attentions), None))
        return sites

    def timestep(self, args: tuple, kwargs: dict) -> object:
        t = super().timestep(args, kwargs)
        if t is not None and argument(args, kwargs, 3, "guidance") is not None:
            return t * 1000  # Sana-Sprint: 0..1 (class doc)
        return t


class SanaVideoFamily(SanaFamily):
    """`SanaVideoTransformer3DModel` (Sana-Video; SanaVideoPipeline, SanaImageToVideoPipeline): Sana's block over a
    `(frames, h, w)` grid of video tokens, the 5-D latent `(B, C, F, H, W)` over `config.patch_size` (`(1, 2, 2)` at
    480p over Wan's VAE, `(1, 1, 1)` at 720p).

    `attn1` is linear self-attention with Wan's 3-D rotary tables, `rotary_emb = (cos, sin)`, each `(1, N, 1, D)`
    (`Layout.ROTARY`, built with `SanaLinearAttnProcessor3_0`): it rotates the queries and keys of the numerator and
    normalizes with the unrotated ones; a merged row keeps the rotation of the token it is kept at. K/V pooling
    cannot pass pooled keys through it (one rotation row per query token): `merge_only`. The image-to-video pipeline
    passes one timestep per token (`(B, 1, F, H, W)`, 0 on the conditioning frame); the blocks modulate each token
    outside the attention, so the merge is unaffected.
    """

    name = "sana_video"
    model_class = SanaVideoTransformer3DModel
    video = True
    needs_row_token = True
    merge_only = True
    vae_scale_factor = 8  # Wan 2.1's VAE (the 480p release; a pipeline's own factor wins)
    frames_per_latent = 4
    self_processor = SanaLinearAttnProcessor3_0
    cross_processor = SanaVideoAttnProcessor2_0
    self_layout = Layout.ROTARY
    # Borrowed from WanFamily (video, 3-D rotary self-attention and text cross-attention); not measured for quality on
    # this model. Speed on this CPU, one block at Sana-Video 2B's width, 480 x 832 px, 5 frames (2 x 30 x 52 tokens),
    # batch 2 (`bench --arch sana_video --layers 1 --resolution 480 --width 832 --frames 5 --rounds 3 --presets
    # balanced fast --ratios 0.5`, load average 6.5): balanced 1.32x, fast 1.24x, ratio 0.5 1.32x (medians).
    defaults = dict(WanFamily.defaults)
    presets = WanFamily.presets

    #: Its pipelines pass the scheduler's 0..1000 and no guidance (Sana-Sprint's rescaling is not for it).
    timestep = Family.timestep

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            return None
        p_t, p_h, p_w = model.config.patch_size
        return int(x.shape[2]) // p_t, int(x.shape[3]) // p_h, int(x.shape[4]) // p_w


#: The model classes of this module ToMe refuses, each with why (`families.family_of` raises it).
#: Sana-WM (transformer_sana_wm.py): every block's self-attention is `BidirectionalGDNUCPESinglePathLiteLA` (every
#: `softmax_every_n`-th, `_SoftmaxUCPESinglePathLiteLA`), an `nn.Module` that computes its projections itself and
#: holds no attention processor; the gated delta rule reshapes the sequence to `(frames, h * w)`, convolves each
#: token's keys along time and keeps a recurrent state per spatial token. Its refiner (transformer_sana_wm_refiner.py,
#: the chunk-causal stage 2 of pipelines/sana_wm/refiner.py): `SanaWMLTX2RefinerAttnProcessor` writes every token's
#: keys and values into `SanaWMRefinerKVCache`, read back by the next windows as the attention sink (re-rotated with
#: `sink_pe`, a table of one row per sink token) and the history (trimmed by frames of `h * w` tokens); its forward
#: gets packed tokens `(B, N, C)` and no grid.
REFUSED: dict[type, str] = {
    SanaWMTransformer3DModel: (
        "Expected a model whose attention ToMe can merge, but got SanaWMTransformer3DModel: its self-attention "
        "(BidirectionalGDNUCPESinglePathLiteLA, and _SoftmaxUCPESinglePathLiteLA every softmax_every_n-th block) is "
        "a module with no attention processor for ToMe to wrap, and its gated delta rule runs a recurrence over the "
        "frames with a state per spatial token (the tokens reshaped to frames x h*w, convolved along time), which "
        "merged tokens would no longer line up with. ToMe cannot merge in this model."
    ),
    SanaWMLTX2RefinerTransformer3DModel: (
        "Expected a model whose attention ToMe can merge, but got SanaWMLTX2RefinerTransformer3DModel: its "
        "self-attention writes every token's keys and values into a KV cache (SanaWMRefinerKVCache) that the next "
        "windows read back as the attention sink, re-rotated with a table of one row per token, and as the history, "
        "trimmed by whole frames; merged tokens would leave the cache with fewer rows than those. Its forward also "
        "gets packed tokens with no token grid. ToMe cannot merge in this model."
    ),
}
