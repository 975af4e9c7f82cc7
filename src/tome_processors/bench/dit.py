"""Diffusion transformers for `tome-processors bench --arch NAME`: random weights, fixed inputs.

The full-size architectures follow the published transformer configs of PixArt-α (XL-2, 1024 px),
Stable Diffusion 3 medium, FLUX.1-dev, Qwen-Image, FLUX.2-dev, Chroma1-HD, Z-Image-Turbo and the video
models Wan2.1-T2V-1.3B, Wan2.1-I2V-14B-480P (`wan-i2v`), LTX-Video 2B, LTX-2 (19 B, audio and video),
HunyuanVideo (13 B) and HunyuanVideo 1.5 (8.3 B; their inputs are a latent clip of `frames` frames at
`resolution x width` pixels, and LTX-2's the audio of that clip).
Nothing is downloaded; weights are diffusers' random initialisation, so speed and memory are those of the
real model while the output change says nothing about image quality. FLUX.1-dev has 12 B parameters: about
48 GB in float32, 24 GB in bfloat16; FLUX.2-dev 32 B. `layers` (`--layers`) keeps the real width and
shortens the depth: at most that many blocks in each block list. `--quick` builds tiny versions with the
same block structure.

Example:
    >>> model = build_transformer("pixart", quick=True)
    >>> inputs = make_transformer_inputs(model, "pixart", batch=1, resolution=64)
    >>> tuple(inputs.run(model).shape)
    (1, 8, 8, 8)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import (
    ChromaTransformer2DModel,
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoTransformer3DModel,
    LTX2VideoTransformer3DModel,
    LTXVideoTransformer3DModel,
    PixArtTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)

from .archs import ARCHS, ArchInputs, LatentShape
from .meta import constructed_on

__all__ = [
    "DECLARED_IMAGE_ARCHITECTURES",
    "DECLARED_VIDEO_ARCHITECTURES",
    "HUNYUANVIDEO15_CONTEXT",
    "QUICK_TEXT_TOKENS",
    "VIDEO_ARCHITECTURES",
    "VIDEO_STRIDES",
    "WAN_I2V_IMAGE_TOKENS",
    "latent_frames",
    "ltx2_audio_frames",
    "TRANSFORMER_ARCHITECTURES",
    "TransformerInputs",
    "build_transformer",
    "make_transformer_inputs",
]

_FULL: dict[str, dict[str, Any]] = {
    "pixart": dict(
        num_attention_heads=16,
        attention_head_dim=72,
        in_channels=4,
        out_channels=8,
        num_layers=28,
        cross_attention_dim=1152,
        sample_size=128,
        patch_size=2,
        caption_channels=4096,
        use_additional_conditions=True,
    ),
    "sd3": dict(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=24,
        attention_head_dim=64,
        num_attention_heads=24,
        joint_attention_dim=4096,
        caption_projection_dim=1536,
        pooled_projection_dim=2048,
        out_channels=16,
        pos_embed_max_size=192,
    ),
    "flux": dict(
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    # Qwen-Image (20 B): 60 double-stream blocks, 3072 wide; Qwen2.5-VL's 3584-wide text.
    "qwenimage": dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=60,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        axes_dims_rope=(16, 56, 56),
    ),
    # FLUX.2-dev (32 B): 8 double- and 48 single-stream blocks, 6144 wide; Mistral's 3 x 5120 text features.
    "flux2": dict(
        patch_size=1,
        in_channels=128,
        num_layers=8,
        num_single_layers=48,
        attention_head_dim=128,
        num_attention_heads=48,
        joint_attention_dim=15360,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32),
        guidance_embeds=True,
    ),
    # Chroma1-HD (8.9 B): FLUX.1's blocks, 3072 wide, modulation from a small approximator.
    "chroma": dict(
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        axes_dims_rope=(16, 56, 56),
        approximator_num_channels=64,
        approximator_hidden_dim=5120,
        approximator_layers=5,
    ),
    # Z-Image-Turbo (6 B): 2 + 2 refiner and 30 main single-stream blocks, 3840 wide; Qwen3-4B's 2560-wide text.
    "zimage": dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=3840,
        n_layers=30,
        n_refiner_layers=2,
        n_heads=30,
        n_kv_heads=30,
        cap_feat_dim=2560,
        axes_dims=[32, 48, 48],
        axes_lens=[1024, 512, 512],
    ),
    "ltx": dict(  # LTX-Video 2B (0.9.x)
        in_channels=128,
        out_channels=128,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=32,
        attention_head_dim=64,
        cross_attention_dim=2048,
        num_layers=28,
        caption_channels=4096,
        qk_norm="rms_norm_across_heads",
    ),
    # LTX-2 (19 B: 48 blocks of a 32 x 128 video stream and a 32 x 64 audio stream), the config diffusers'
    # scripts/convert_ltx2_to_diffusers.py gives version "2.0": the class's defaults but for its split rotary tables.
    "ltx2": dict(
        in_channels=128,
        out_channels=128,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=32,
        attention_head_dim=128,
        cross_attention_dim=4096,
        audio_in_channels=128,
        audio_out_channels=128,
        audio_num_attention_heads=32,
        audio_attention_head_dim=64,
        audio_cross_attention_dim=2048,
        num_layers=48,
        caption_channels=3840,
        rope_double_precision=True,
        rope_type="split",
    ),
    "wan": dict(  # Wan2.1-T2V-1.3B
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    # HunyuanVideo (13 B): 20 double- and 40 single-stream blocks, 24 heads x 128; Llama's 4096-wide text, CLIP-L's
    # 768-wide pooled projection; guidance-distilled.
    "hunyuanvideo": dict(
        in_channels=16,
        out_channels=16,
        num_attention_heads=24,
        attention_head_dim=128,
        num_layers=20,
        num_single_layers=40,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=2,
        patch_size_t=1,
        qk_norm="rms_norm",
        guidance_embeds=True,
        text_embed_dim=4096,
        pooled_projection_dim=768,
        rope_theta=256.0,
        rope_axes_dim=(16, 56, 56),
    ),
    # HunyuanVideo 1.5 (8.3 B): 54 double-stream blocks, 16 heads x 128; the latent (32 channels), the first
    # frame's condition (32) and its mask (1) over channels; Qwen2.5-VL-7B's 3584-wide text, ByT5's 1472-wide
    # glyph text, SigLIP's 1152-wide image embedding. The "480p_t2v" config of diffusers'
    # scripts/convert_hunyuan_video1_5_to_diffusers.py (the class's defaults, with task_type "t2v").
    "hunyuanvideo15": dict(
        in_channels=65,
        out_channels=32,
        num_attention_heads=16,
        attention_head_dim=128,
        num_layers=54,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=3584,
        text_embed_2_dim=1472,
        image_embed_dim=1152,
        rope_theta=256.0,
        rope_axes_dim=(16, 56, 56),
        use_meanflow=False,
        target_size=640,
        task_type="t2v",
    ),
    # Wan2.1-I2V-14B-480P: 40 blocks, 40 heads x 128, ffn 13824; the noisy latent (16 channels), the first
    # frame's mask (4) and its latent (16) over channels; CLIP ViT-H/14's 1280-wide image tokens, with their own
    # keys and values in cross-attention (`added_kv_proj_dim`). The "Wan-I2V-14B-480p" config of diffusers'
    # scripts/convert_wan_to_diffusers.py.
    "wan-i2v": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=40,
        attention_head_dim=128,
        in_channels=36,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=13824,
        num_layers=40,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=1280,
        added_kv_proj_dim=5120,
    ),
}
_QUICK: dict[str, dict[str, Any]] = {
    "pixart": dict(_FULL["pixart"], num_attention_heads=2, attention_head_dim=16, num_layers=2, cross_attention_dim=32,
                   sample_size=16, caption_channels=32, use_additional_conditions=False),
    "sd3": dict(_FULL["sd3"], sample_size=16, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                pos_embed_max_size=32),
    "flux": dict(_FULL["flux"], in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    "qwenimage": dict(_FULL["qwenimage"], in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                      num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4)),
    "flux2": dict(_FULL["flux2"], in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
                  axes_dims_rope=(4, 4, 4, 4)),
    "chroma": dict(_FULL["chroma"], in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
                   approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1),
    "zimage": dict(_FULL["zimage"], in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                   cap_feat_dim=32, axes_dims=[8, 4, 4], axes_lens=[256, 64, 64]),
    "ltx": dict(_FULL["ltx"], in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                cross_attention_dim=16, num_layers=2, caption_channels=32),
    "ltx2": dict(_FULL["ltx2"], in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                 cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
                 audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=32),
    "wan": dict(_FULL["wan"], num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=32,
                freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=1024),
    "hunyuanvideo": dict(_FULL["hunyuanvideo"], in_channels=4, out_channels=4, num_attention_heads=2,
                         attention_head_dim=16, num_layers=1, num_single_layers=2, num_refiner_layers=1,
                         text_embed_dim=32, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6)),
    "hunyuanvideo15": dict(_FULL["hunyuanvideo15"], in_channels=9, out_channels=4, num_attention_heads=2,
                           attention_head_dim=16, num_layers=2, num_refiner_layers=1, text_embed_dim=32,
                           text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(4, 6, 6)),
    "wan-i2v": dict(_FULL["wan-i2v"], num_attention_heads=2, attention_head_dim=12, in_channels=12, out_channels=4,
                    text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, image_dim=16, added_kv_proj_dim=24),
}  # fmt: skip

#: Architecture name -> transformer config (the full-size one).
TRANSFORMER_ARCHITECTURES = _FULL
#: Text tokens of each family's pipeline: PixArt-α's T5 (120), SD3's CLIP + T5 (77 + 256), Flux's T5 (512),
#: FLUX.2's Mistral and Chroma's T5 (padded to 512), Wan's UMT5 (512), HunyuanVideo's Llama (padded to 256),
#: LTX-2's Gemma 3 (padded to 1,024, the padding replaced by its connectors' registers: all attended),
#: HunyuanVideo 1.5's Qwen2.5-VL (padded to 1,000; its ByT5 and image tokens: `HUNYUANVIDEO15_CONTEXT`);
#: Qwen-Image and Z-Image do not pad their prompts: 128 stands for a long prompt.
TEXT_TOKENS = {
    "pixart": 120,
    "sd3": 333,
    "flux": 512,
    "qwenimage": 128,
    "flux2": 512,
    "chroma": 512,
    "zimage": 128,
    "wan": 512,
    "ltx": 128,
    "ltx2": 1024,
    "hunyuanvideo": 256,
    "hunyuanvideo15": 1000,
    "wan-i2v": 512,
}
#: HunyuanVideo 1.5's other context tokens, full size and `--quick`: ByT5's glyph text (the pipeline pads it to
#: 256, all masked when the prompt quotes no text) and the image embedding (SigLIP's 729 tokens; zeros, all
#: masked, in text-to-video). The model attends over all of them (masked), so they cost what they would.
HUNYUANVIDEO15_CONTEXT = {"byt5": (256, 4), "image": (729, 3)}
#: Wan2.1 I2V's image tokens, full size and `--quick`: CLIP ViT-H/14's 16 x 16 patches and its class token.
WAN_I2V_IMAGE_TOKENS = (257, 5)
#: Wan's I2V attention takes the last 512 context tokens as the text (diffusers hardcodes it): its text is
#: always 512 tokens, `--quick` too.
_WAN_I2V_TEXT_TOKENS = 512
#: The config fields that set a model's depth (`layers` caps each).
_DEPTH_FIELDS = ("num_layers", "num_single_layers", "n_layers", "n_refiner_layers")
#: Video architectures: inputs are clips (`frames`, and `width` beside `resolution`, the height).
VIDEO_ARCHITECTURES = ("wan", "wan-i2v", "ltx", "ltx2", "hunyuanvideo", "hunyuanvideo15")
#: A video architecture's clip when none is given: height, width, pixel frames (Wan's 480p, 33 frames;
#: Wan I2V's 480p, 81 frames, `WanImageToVideoPipeline`'s defaults; LTX-Video's and LTX-2's 512 x 768, 121
#: frames; HunyuanVideo's 544 x 960, 33 frames; HunyuanVideo 1.5's 480 x 848, 121 frames, its pipeline's
#: defaults for the 480p models: 16:9 at `target_size` 640, rounded to its VAE's 16 pixels).
VIDEO_DEFAULTS = {
    "wan": (480, 832, 33),
    "wan-i2v": (480, 832, 81),
    "ltx": (512, 768, 121),
    "ltx2": (512, 768, 121),
    "hunyuanvideo": (544, 960, 33),
    "hunyuanvideo15": (480, 848, 121),
}
#: The VAE's stride in time and space (Wan's and HunyuanVideo's: 4 frames, 8 pixels; LTX-Video's and LTX-2's:
#: 8 frames, 32 pixels; HunyuanVideo 1.5's: 4 frames, 16 pixels).
VIDEO_STRIDES = {
    "wan": (4, 8),
    "wan-i2v": (4, 8),
    "ltx": (8, 32),
    "ltx2": (8, 32),
    "hunyuanvideo": (4, 8),
    "hunyuanvideo15": (4, 16),
}
#: LTX-2's pipelines' frame rate when none is given (the audio's length follows the clip's duration).
LTX2_FRAME_RATE = 24.0
#: Text tokens for the `--quick` models.
QUICK_TEXT_TOKENS = 16

# The architectures declared in `bench.archs` (one module per family group) join the tables above.
_FULL.update({name: arch.full for name, arch in ARCHS.items()})
_QUICK.update({name: arch.quick for name, arch in ARCHS.items()})
TEXT_TOKENS.update({name: arch.text_tokens for name, arch in ARCHS.items()})
#: The video architectures declared in `bench.archs`.
DECLARED_VIDEO_ARCHITECTURES = tuple(name for name, arch in ARCHS.items() if arch.video is not None)
VIDEO_ARCHITECTURES = (*VIDEO_ARCHITECTURES, *DECLARED_VIDEO_ARCHITECTURES)
VIDEO_DEFAULTS.update({name: (a.video.height, a.video.width, a.video.frames) for name, a in ARCHS.items() if a.video})
VIDEO_STRIDES.update({name: (a.video.time_stride, a.video.space_stride) for name, a in ARCHS.items() if a.video})
#: The image architectures declared in `bench.archs` (forwards only: no random-weight pipeline in bench/).
DECLARED_IMAGE_ARCHITECTURES = tuple(name for name, arch in ARCHS.items() if arch.video is None)


_MODEL_CLASSES: dict[str, type] = {
    "pixart": PixArtTransformer2DModel,
    "sd3": SD3Transformer2DModel,
    "flux": FluxTransformer2DModel,
    "qwenimage": QwenImageTransformer2DModel,
    "flux2": Flux2Transformer2DModel,
    "chroma": ChromaTransformer2DModel,
    "zimage": ZImageTransformer2DModel,
    "wan": WanTransformer3DModel,
    "ltx": LTXVideoTransformer3DModel,
    "ltx2": LTX2VideoTransformer3DModel,
    "hunyuanvideo": HunyuanVideoTransformer3DModel,
    "hunyuanvideo15": HunyuanVideo15Transformer3DModel,
    "wan-i2v": WanTransformer3DModel,
    **{name: arch.model_class for name, arch in ARCHS.items()},
}


def build_transformer(
    arch: str,
    quick: bool = False,
    seed: int = 0,
    layers: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """A diffusion transformer of the named architecture with random weights (seeded), in eval mode.

    `layers`: at most that many blocks in each of the model's block lists (the real width, a shorter depth;
    a CPU cannot run all 30 of Wan's at a clip's token count; speed-ups are then per block).
    `device` and `dtype`: where the weights are made (`meta.constructed_on`: FLUX.2's 32 B parameters never
    exist in float32 on the host); None: on the CPU in float32, for the caller to cast (a device's random
    numbers differ from the CPU's, so the two give different weights).

    Example:
        >>> type(build_transformer("sd3", quick=True)).__name__
        'SD3Transformer2DModel'
        >>> build_transformer("flux2", quick=True, layers=1).config.num_single_layers
        1
    """
    if arch not in _FULL:
        raise ValueError(f"Expected arch among {sorted(_FULL)}, but got {arch!r}.")
    if layers is not None and layers < 1:
        raise ValueError(f"Expected layers >= 1, but got {layers}.")
    config = dict((_QUICK if quick else _FULL)[arch])
    declared = ARCHS.get(arch)
    if layers is not None:
        depth = declared.depth_fields if declared is not None else _DEPTH_FIELDS
        config.update({name: min(config[name], layers) for name in depth if name in config})
    if declared is not None and declared.derived is not None:
        config = declared.derived(config)
    torch.manual_seed(seed)
    if device is None and dtype is None:
        return _MODEL_CLASSES[arch](**config).eval()
    with constructed_on(device or "cpu", dtype or torch.float32):
        return _MODEL_CLASSES[arch](**config).eval()


def latent_frames(arch: str, frames: int) -> int:
    """The latent frames of a clip of `frames` pixel frames: `1 + (frames - 1) // stride` (Wan's VAE: 4).

    Example:
        >>> latent_frames("wan", 33), latent_frames("wan", 81)
        (9, 21)
    """
    return 1 + (frames - 1) // VIDEO_STRIDES[arch][0]


def ltx2_audio_frames(model: torch.nn.Module, frames: int, frame_rate: float = LTX2_FRAME_RATE) -> int:
    """The audio latents (tokens) LTX-2's pipeline makes for a clip of `frames` pixel frames: the clip's duration
    times the audio latents a second (`audio_sampling_rate / audio_hop_length / audio_scale_factor`: 25).

    Example:
        >>> ltx2_audio_frames(build_transformer("ltx2", quick=True), 121)  # 121 / 24 s x 25 a second
        126
    """
    config = model.config
    per_second = config.audio_sampling_rate / config.audio_hop_length / config.audio_scale_factor
    return round(frames / frame_rate * per_second)


@dataclass
class TransformerInputs:
    """Fixed keyword inputs of one transformer forward, the same for every method."""

    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self, model: torch.nn.Module) -> torch.Tensor:
        """One forward (by keyword, as the pipelines call it); returns the output sample."""
        with torch.inference_mode():
            sample = model(**self.kwargs).sample
        return torch.stack(sample) if isinstance(sample, list) else sample  # Z-Image: one tensor per sample


def make_transformer_inputs(
    model: torch.nn.Module,
    arch: str,
    batch: int,
    resolution: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_tokens: int | None = None,
    frames: int | None = None,
    width: int | None = None,
    quick: bool = False,
) -> TransformerInputs:
    """Random fixed inputs for `model` at `resolution` pixels (latent side `resolution // 8`).

    `text_tokens` defaults to the family pipeline's prompt length (`TEXT_TOKENS`). A video architecture's
    clip is `frames` pixel frames (`latent_frames` in the latent) of `resolution x width` pixels. `quick`: the
    `--quick` model's short image and glyph contexts (`WAN_I2V_IMAGE_TOKENS`, `HUNYUANVIDEO15_CONTEXT`); Wan
    I2V's text is 512 tokens whatever `text_tokens` says (its attention splits the context at 512 from the end).

    Example:
        >>> flux = build_transformer("flux", quick=True)
        >>> make_transformer_inputs(flux, "flux", 1, 64).kwargs["hidden_states"].shape  # 4 x 4 packed tokens
        torch.Size([1, 16, 16])
    """
    config = model.config
    g = torch.Generator().manual_seed(seed)
    side = resolution // 8
    if arch not in _FULL:
        raise ValueError(f"Expected arch among {sorted(_FULL)}, but got {arch!r}.")
    text_len = TEXT_TOKENS[arch] if text_tokens is None else text_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    declared = ARCHS.get(arch)
    if declared is not None:  # as its pipeline calls the model (`bench.archs`)
        if declared.video is not None:
            clip = declared.video
            latent = (
                latent_frames(arch, frames or clip.frames),
                resolution // clip.space_stride,
                (width or clip.width) // clip.space_stride,
            )
        else:
            latent = (1, resolution // declared.space_stride, resolution // declared.space_stride)
        shape = LatentShape(batch, *latent, text_tokens=text_len)
        return TransformerInputs(declared.inputs(ArchInputs(model, shape, randn, device, dtype, quick)))

    if arch == "pixart":
        added = None
        if model.use_additional_conditions:
            added = {
                "resolution": torch.tensor([[resolution, resolution]] * batch, dtype=dtype, device=device),
                "aspect_ratio": torch.ones(batch, 1, dtype=dtype, device=device),
            }
        kwargs = {
            "hidden_states": randn(batch, config.in_channels, side, side),
            "encoder_hidden_states": randn(batch, text_len, config.caption_channels),
            "timestep": torch.full((batch,), 500, device=device),
            "added_cond_kwargs": added,
        }
    elif arch == "flux":
        grid = side // 2  # the Flux pipelines pack 2 x 2 latent patches into one token
        ids = torch.zeros(grid, grid, 3)
        ids[..., 1] = torch.arange(grid)[:, None]
        ids[..., 2] = torch.arange(grid)[None, :]
        kwargs = {
            "hidden_states": randn(batch, grid * grid, config.in_channels),
            "encoder_hidden_states": randn(batch, text_len, config.joint_attention_dim),
            "pooled_projections": randn(batch, config.pooled_projection_dim),
            "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
            "img_ids": ids.view(-1, 3).to(device, dtype),
            "txt_ids": torch.zeros(text_len, 3, device=device, dtype=dtype),
            "guidance": torch.full((batch,), 3.5, device=device, dtype=dtype),
        }
    elif arch in ("flux2", "chroma"):
        grid = side // 2  # 2 x 2 latent patches per token (FLUX.2's VAE: 16x with packing, the same token count)
        columns = 4 if arch == "flux2" else 3
        ids = torch.zeros(grid, grid, columns)
        ids[..., 1] = torch.arange(grid)[:, None]
        ids[..., 2] = torch.arange(grid)[None, :]
        text_ids = torch.zeros(text_len, columns)
        if arch == "flux2":
            text_ids[:, 3] = torch.arange(text_len)
        kwargs = {
            "hidden_states": randn(batch, grid * grid, config.in_channels),
            "encoder_hidden_states": randn(batch, text_len, config.joint_attention_dim),
            "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
            "img_ids": ids.view(-1, columns).to(device, dtype),
            "txt_ids": text_ids.to(device, dtype),
        }
        if arch == "flux2" and config.guidance_embeds:
            kwargs["guidance"] = torch.full((batch,), 4.0, device=device, dtype=dtype)
    elif arch == "qwenimage":
        grid = side // 2
        kwargs = {
            "hidden_states": randn(batch, grid * grid, config.in_channels),
            "encoder_hidden_states": randn(batch, text_len, config.joint_attention_dim),
            "encoder_hidden_states_mask": torch.ones(batch, text_len, dtype=torch.long, device=device),
            "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
            "img_shapes": [[(1, grid, grid)]] * batch,
        }
    elif arch == "zimage":
        kwargs = {
            "x": [randn(config.in_channels, 1, side, side) for _ in range(batch)],
            "t": torch.full((batch,), 0.5, device=device, dtype=dtype),
            "cap_feats": [randn(text_len, config.cap_feat_dim) for _ in range(batch)],
        }
    elif arch == "ltx":  # packed tokens, the latent grid as ints
        _, default_width, default_frames = VIDEO_DEFAULTS[arch]
        stride = VIDEO_STRIDES[arch][1]
        grid = latent_frames(arch, frames or default_frames), resolution // stride, (width or default_width) // stride
        kwargs = {
            "hidden_states": randn(batch, grid[0] * grid[1] * grid[2], config.in_channels),
            "encoder_hidden_states": randn(batch, text_len, config.caption_channels),
            "timestep": torch.full((batch,), 500, device=device),
            "encoder_attention_mask": torch.ones(batch, text_len, device=device, dtype=dtype),
            "num_frames": grid[0],
            "height": grid[1],
            "width": grid[2],
        }
    elif arch == "ltx2":  # LTX-Video's packed tokens and grid, the clip's audio latents, a text for each stream
        _, default_width, default_frames = VIDEO_DEFAULTS[arch]
        stride = VIDEO_STRIDES[arch][1]
        pixel_frames = frames or default_frames
        grid = latent_frames(arch, pixel_frames), resolution // stride, (width or default_width) // stride
        audio = ltx2_audio_frames(model, pixel_frames)
        timestep = torch.full((batch,), 500.0, device=device)
        kwargs = {
            "hidden_states": randn(batch, grid[0] * grid[1] * grid[2], config.in_channels),
            "audio_hidden_states": randn(batch, audio, config.audio_in_channels),
            "encoder_hidden_states": randn(batch, text_len, config.caption_channels),
            "audio_encoder_hidden_states": randn(batch, text_len, config.caption_channels),
            "timestep": timestep,
            "sigma": timestep,
            "encoder_attention_mask": torch.ones(batch, text_len, device=device, dtype=dtype),
            "audio_encoder_attention_mask": torch.ones(batch, text_len, device=device, dtype=dtype),
            "num_frames": grid[0],
            "height": grid[1],
            "width": grid[2],
            "fps": LTX2_FRAME_RATE,
            "audio_num_frames": audio,
        }
    elif arch == "hunyuanvideo":  # a latent clip, the Llama text, CLIP's pooled projection, distilled guidance
        _, default_width, default_frames = VIDEO_DEFAULTS[arch]
        stride = VIDEO_STRIDES[arch][1]
        clip = (latent_frames(arch, frames or default_frames), resolution // stride, (width or default_width) // stride)
        kwargs = {
            "hidden_states": randn(batch, config.in_channels, *clip),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
            "encoder_hidden_states": randn(batch, text_len, config.text_embed_dim),
            "encoder_attention_mask": torch.ones(batch, text_len, dtype=torch.long, device=device),
            "pooled_projections": randn(batch, config.pooled_projection_dim),
            "guidance": torch.full((batch,), 6000.0, device=device, dtype=dtype),  # the pipeline's 6.0 * 1000
        }
    elif arch == "hunyuanvideo15":  # as its text-to-video pipeline calls it: Qwen's text, ByT5 and the image masked
        _, default_width, default_frames = VIDEO_DEFAULTS[arch]
        stride = VIDEO_STRIDES[arch][1]
        clip = (latent_frames(arch, frames or default_frames), resolution // stride, (width or default_width) // stride)
        byt5, image = (HUNYUANVIDEO15_CONTEXT[name][1 if quick else 0] for name in ("byt5", "image"))
        zeros = dict(device=device, dtype=dtype)
        kwargs = {
            "hidden_states": randn(batch, config.in_channels, *clip),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
            "encoder_hidden_states": randn(batch, text_len, config.text_embed_dim),
            "encoder_attention_mask": torch.ones(batch, text_len, dtype=torch.long, device=device),
            # a prompt without quoted text: the pipeline's zero ByT5 features, all masked
            "encoder_hidden_states_2": torch.zeros(batch, byt5, config.text_embed_2_dim, **zeros),
            "encoder_attention_mask_2": torch.zeros(batch, byt5, dtype=torch.long, device=device),
            # text to video: zero image embeddings, which the model masks
            "image_embeds": torch.zeros(batch, image, config.image_embed_dim, **zeros),
        }
    elif arch in VIDEO_ARCHITECTURES:  # Wan: a latent clip and the UMT5 text (I2V: CLIP's image tokens too)
        _, default_width, default_frames = VIDEO_DEFAULTS[arch]
        stride = VIDEO_STRIDES[arch][1]
        clip = (latent_frames(arch, frames or default_frames), resolution // stride, (width or default_width) // stride)
        image_dim = config.get("image_dim")  # set in the I2V models (a loaded one with `--model` too)
        if image_dim is not None:
            text_len = _WAN_I2V_TEXT_TOKENS
        kwargs = {
            "hidden_states": randn(batch, config.in_channels, *clip),
            "timestep": torch.full((batch,), 500, device=device),
            "encoder_hidden_states": randn(batch, text_len, config.text_dim),
        }
        if image_dim is not None:
            tokens = WAN_I2V_IMAGE_TOKENS[1 if quick else 0]
            kwargs["encoder_hidden_states_image"] = randn(batch, tokens, image_dim)
    else:  # sd3
        kwargs = {
            "hidden_states": randn(batch, config.in_channels, side, side),
            "encoder_hidden_states": randn(batch, text_len, config.joint_attention_dim),
            "pooled_projections": randn(batch, config.pooled_projection_dim),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
        }
    return TransformerInputs(kwargs)
