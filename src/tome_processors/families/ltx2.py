"""LTX-2: an audio-video diffusion transformer; only its video tokens merge, in the video self-attention."""

from __future__ import annotations

from diffusers import LTX2VideoTransformer3DModel

from .base import Rotary
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
    """

    # LTX-Video's declaration and Wan's presets (docs/video.md), measured on the trained Wan-shaped video
    # model, not on LTX-2 itself; no speed was measured on LTX-2 when it was added.
    name = "ltx2"
    model_class = LTX2VideoTransformer3DModel
    rotary = Rotary(name="query_rotary_emb", position=2, covers_text=False, batched=True)
    timestep_position = 4

    # After the video and audio latents, their texts, `timestep`, `audio_timestep`, `sigma`, `audio_sigma` and
    # the two text masks.
    grid_arguments = ((10, "num_frames"), (11, "height"), (12, "width"))
