"""LTX-2: an audio-video diffusion transformer; only its video tokens merge, in the video self-attention."""

from __future__ import annotations

from dataclasses import replace

import torch
from diffusers import LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import LTX2Attention, LTX2PerturbedAttnProcessor

from .base import BlockSite, Rotary
from .ltx import LTXVideoFamily


class LTX2Family(LTXVideoFamily):
    """`LTX2VideoTransformer3DModel` (LTX-2): `LTX2VideoTransformerBlock`s over packed video and audio tokens.

    Each block runs a video stream and an audio stream. ToMe declares, as on LTX-Video, each block's video
    self-attention `attn1` (3-D rotary tables as `query_rotary_emb`, one `(cos, sin)` per sample: `(B, N, D)`
    with `rope_type="interleaved"`, `(B, H, N, D / H / 2)` with `"split"`, the released model's; a merged row
    keeps the rotation of the token it is kept at), the video-text cross-attention `attn2` (its queries merged
    only with `merge_crossattn`) and the video feed-forward `ff` (`merge_mlp`). Never merged: the audio
    stream (`audio_attn1`, `audio_attn2`, `audio_ff`), the text, and both audio-video cross-attentions:
    `video_to_audio_attn` takes the video tokens as keys and values, and `audio_to_video_attn` (video queries,
    audio keys) rotates its queries with tables of its own, so it is left whole rather than merged with a
    second gather. A video self-attention mask (`video_self_attention_mask`, the IC-LoRA pipeline's) leaves
    `attn1` unmerged. The grid is `num_frames`, `height`, `width` (Python ints, the latent's) over
    `config.patch_size_t` / `config.patch_size`; the pipelines pass the timestep on the 0..1000 scale.
    LTX-2.3's models (`config.perturbed_attn`) build all six attention modules of each block with
    `LTX2PerturbedAttnProcessor`, through which the pipelines' spatio-temporal guidance (STG) skips attention: a
    `ToMeProcessor()` without an inner processor runs that one there, and removal puts it back.
    """

    # LTX-Video's declaration and Wan's presets (docs/video.md), measured on the trained Wan-shaped video
    # model, not on LTX-2 itself (its speed on a GPU: docs/benchmarks.md).
    name = "ltx2"
    vae_scale_factor = 32
    frames_per_latent = 8
    model_class = LTX2VideoTransformer3DModel
    rotary = Rotary(name="query_rotary_emb", position=2, covers_text=False, batched=True)
    timestep_position = 4

    # After the video and audio latents, their texts, `timestep`, `audio_timestep`, `sigma`, `audio_sigma` and
    # the two text masks.
    grid_arguments = ((10, "num_frames"), (11, "height"), (12, "width"))

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites = super().blocks(model)
        built = _built_with(model)
        if built is None:
            return sites
        return [replace(s, attentions=tuple(replace(a, built_with=built) for a in s.attentions)) for s in sites]

    def built_processor(self, model: torch.nn.Module, attn: torch.nn.Module) -> type | None:
        # The modules ToMe merges nothing in too (the audio stream's, the audio-video cross-attentions).
        built = _built_with(model)
        if built is not None and isinstance(attn, LTX2Attention):
            return built
        return super().built_processor(model, attn)


def _built_with(model: torch.nn.Module) -> type | None:
    """The processor `model` builds every attention module of its blocks with, where not `LTX2Attention`'s default:
    LTX-2.3's (`perturbed_attn`), through which its pipelines' spatio-temporal guidance skips attention."""
    return LTX2PerturbedAttnProcessor if getattr(model.config, "perturbed_attn", False) else None
