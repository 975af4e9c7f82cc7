"""JoyImage-Edit (and Plus), OmniGen, Motif-Video, AnyFlow and DreamLite's transformer (`families/edit_more.py`).

Tiny random-weight models: diffusers' own test configs, at most 2 blocks a list. Inputs as each pipeline calls its
model: batch 2, a 6 x 8 token grid a frame, 7 text tokens; the edit models with a reference image's tokens beside the
generated image's (never merged). Tiny offline pipelines where diffusers has one whose text encoder builds tiny.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AnyFlowPipeline,
    AnyFlowTransformer3DModel,
    AutoencoderKLWan,
    DreamLiteTransformer2DModel,
    FlowMapEulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    JoyImageEditPipeline,
    JoyImageEditPlusPipeline,
    JoyImageEditPlusTransformer3DModel,
    JoyImageEditTransformer3DModel,
    MotifVideoPipeline,
    MotifVideoTransformer3DModel,
    OmniGenTransformer2DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.pipelines.joyimage.image_processor import JoyImageEditImageProcessor
from PIL import Image
from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, T5Gemma2Encoder
from transformers.models.t5gemma2.configuration_t5gemma2 import T5Gemma2EncoderConfig

from tome_processors.bench.pipelines import write_t5_tokenizer

from family_cases import FamilyCase, PipelineCase
from test_new_families import ImageOnlyQwen2VLProcessor, write_qwen_tokenizer

TEXT, H, W = 7, 6, 8
#: A 4 x 4 reference image (JoyImage-Edit Plus's second sample: 2 x 4, padded to the first's).
REFERENCE = (4, 4)


# ---------------------------------------------------------------- JoyImage-Edit and Plus

#: diffusers' test config of both JoyImage transformers: 2 heads of 16, rotary dims 4 + 6 + 6.
_JOY = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=2,
            rope_dim_list=[4, 6, 6], theta=256)  # fmt: skip


def tiny_joyimage(rope_type: str = "rope") -> JoyImageEditTransformer3DModel:
    """diffusers' test config; `rope_type="mrope"` rotates the text too (its own table, after the image's)."""
    torch.manual_seed(0)
    return JoyImageEditTransformer3DModel(**_JOY, rope_type=rope_type).eval()


def joyimage_inputs(batch: int = 2, items: int = 2) -> dict:
    """As `JoyImageEditPipeline` calls the model: `(B, items, C, 1, 2H, 2W)`, the image to edit then the noise (one
    item: text-to-image), the scheduler's timestep and the prompt's hidden states."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, items, 16, 1, 2 * H, 2 * W, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=g),
    }


def tiny_joyimage_plus() -> JoyImageEditPlusTransformer3DModel:
    torch.manual_seed(0)
    return JoyImageEditPlusTransformer3DModel(**_JOY).eval()


def joyimage_plus_inputs(batch: int = 2) -> dict:
    """As `JoyImageEditPlusPipeline` calls the model: per sample the generated image's `H x W` patches, then a
    reference image's (4 x 4, then 2 x 4), padded to the longest; `shape_list`; the prompt's mask (the second prompt's
    last two tokens padding)."""
    g = torch.Generator().manual_seed(0)
    references = [REFERENCE, (2, 4)][:batch]
    shapes = [[(1, H, W), (1, *reference)] for reference in references]
    longest = max(H * W + h * w for h, w in references)
    patches = torch.zeros(batch, longest, 16, 1, 2, 2)
    for b, (h, w) in enumerate(references):
        patches[b, : H * W + h * w] = torch.randn(H * W + h * w, 16, 1, 2, 2, generator=g)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[1:, -2:] = 0
    return {
        "hidden_states": patches,
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=g),
        "encoder_hidden_states_mask": mask,
        "shape_list": shapes,
    }


# ---------------------------------------------------------------- OmniGen


def tiny_omnigen() -> OmniGenTransformer2DModel:
    """diffusers' test config with 2 layers: 4 heads of 4, rotary scaling factors for its 2 frequencies."""
    torch.manual_seed(0)
    return OmniGenTransformer2DModel(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_layers=2,
        pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
        rope_scaling={"long_factor": [1.0, 2.0], "short_factor": [1.0, 2.0]},
    ).eval()  # fmt: skip


def omnigen_mask(condition: int, image: int, spans: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """`OmniGenCollator`'s mask (no padding): the `condition` tokens and the time token attend causally, each input
    image span within itself, the generated `image` tokens to everything."""
    length = condition + 1 + image
    mask = torch.zeros(length, length)
    mask[: condition + 1, : condition + 1] = torch.ones(condition + 1, condition + 1).tril()
    mask[condition + 1 :] = 1
    for start, end in spans:
        mask[start:end, start:end] = 1
    return mask


def omnigen_inputs(batch: int = 2, reference: tuple[int, int] | None = None) -> dict:
    """As `OmniGenPipeline` calls the model: the prompt's token ids (with a reference image, its `h x w` placeholder
    tokens after the third, replaced by its latent's patches), its latents, the mask, positions and `t` in 0..1."""
    g = torch.Generator().manual_seed(0)
    spans, latents, sizes = (), [], {}
    condition = TEXT
    if reference is not None:
        h, w = reference
        spans = ((3, 3 + h * w),)
        condition += h * w
        latents = [torch.randn(1, 4, 2 * h, 2 * w, generator=g) for _ in range(batch)]
        sizes = {b: [list(spans[0])] for b in range(batch)}
    length = condition + 1 + H * W
    ids = torch.randint(1, 1000, (batch, condition), generator=g)
    return {
        "hidden_states": torch.randn(batch, 4, 2 * H, 2 * W, generator=g),
        "timestep": torch.full((batch,), 0.4),
        "input_ids": ids,
        "input_img_latents": latents,
        "input_image_sizes": sizes,
        "attention_mask": omnigen_mask(condition, H * W, spans).expand(batch, length, length).clone(),
        "position_ids": torch.arange(length).expand(batch, length).clone(),
    }


# ---------------------------------------------------------------- Motif-Video


def tiny_motif_video(latent: int = 16, text_dim: int = 32) -> MotifVideoTransformer3DModel:
    """diffusers' test config with a DDT decoder block and the single-stream blocks' shared cross-attention (as the
    released model): one double-stream and 2 single-stream blocks, the last a decoder block. Its input is `latent`
    noisy channels, as many of the condition and a mask's."""
    torch.manual_seed(0)
    return MotifVideoTransformer3DModel(
        in_channels=2 * latent + 1, out_channels=latent, num_attention_heads=2, attention_head_dim=12, num_layers=1,
        num_single_layers=2, num_decoder_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=text_dim,
        image_embed_dim=4, rope_axes_dim=(4, 4, 4), enable_text_cross_attention_single=True,
    ).eval()  # fmt: skip


def motif_video_inputs(batch: int = 2, frames: int = 2) -> dict:
    """As `MotifVideoImage2VideoPipeline` calls the model: latents, condition and mask in 33 channels, the image's
    SigLIP tokens (3, ahead of the text), the prompt's mask (the second prompt's last two tokens padding)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, TEXT, dtype=torch.bool)
    mask[1:, -2:] = False
    return {
        "hidden_states": torch.randn(batch, 33, frames, H, W, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, 32, generator=g),
        "encoder_attention_mask": mask,
        "image_embeds": torch.randn(batch, 3, 4, generator=g),
    }


# ---------------------------------------------------------------- AnyFlow


def tiny_anyflow() -> AnyFlowTransformer3DModel:
    """diffusers' test config: 2 blocks of 2 heads of 12."""
    torch.manual_seed(0)
    return AnyFlowTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    ).eval()  # fmt: skip


def anyflow_inputs(batch: int = 2, frames: int = 2) -> dict:
    """As `AnyFlowPipeline` calls the model: latents frames first, `(B, F, C, 2H, 2W)`, the timestep and the target
    timestep per frame."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, frames, 4, 2 * H, 2 * W, generator=g),
        "timestep": torch.full((batch, frames), 500.0),
        "r_timestep": torch.full((batch, frames), 250.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=g),
    }


# ---------------------------------------------------------------- DreamLite


def tiny_dreamlite() -> DreamLiteTransformer2DModel:
    """2 blocks of 4 heads of 8 with DreamLite's knobs (`qk_norm`, `ff_mult`); multi-head keys (the U-Net's
    grouped-query attention needs its own processor, which it sets)."""
    torch.manual_seed(0)
    return DreamLiteTransformer2DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=32, num_layers=2, norm_num_groups=8,
        cross_attention_dim=16, qk_norm="rms_norm", ff_mult=2,
    ).eval()  # fmt: skip


def dreamlite_inputs(batch: int = 2) -> dict:
    """As DreamLite's U-Net calls it: its level's feature map and the prompt."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, 32, H, W, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=g),
    }


# ---------------------------------------------------------------- tiny offline pipelines

#: Pipeline calls: 32 x 32 px, 2 steps (the videos: 5 frames, 2 latent frames).
SIDE, FRAMES = 32, 5


def picture(height: int = SIDE, width: int = SIDE, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


class GivenSizeImageProcessor(JoyImageEditImageProcessor):
    """JoyImage's image processor without its buckets (every one 512 to 2048 px a side, about 1024 x 1024 px): the
    call's size where it gives one, else the image's. Images are resized and cropped as the real one does."""

    def get_default_height_width(self, image, height=None, width=None) -> tuple[int, int]:  # noqa: ANN001
        if height is not None and width is not None:
            return height, width
        first = image[0] if isinstance(image, list) else image
        return first.height, first.width


class MeanEncodingWanVAE(AutoencoderKLWan):
    """The Wan VAE, its encodings' posteriors without spread: `JoyImageEditPipeline` samples the reference image's
    latent without the call's generator (`latent_dist.sample()`), so two calls with one seed would differ; here the
    sample is the posterior's mean (JoyImage-Edit Plus's pipeline takes the mean itself: `latent_dist.mode()`)."""

    def encode(self, x: torch.Tensor, return_dict: bool = True):  # noqa: ANN201
        out = super().encode(x, return_dict=return_dict)
        posterior = out.latent_dist if return_dict else out[0]
        posterior.std = torch.zeros_like(posterior.std)
        return out


def _joyimage_parts(folder: Path) -> dict:
    """JoyImage's text encoder (Qwen3-VL of one text and one vision layer, its last layer's hidden states 16 wide, as
    `text_dim`), the Qwen tokenizer with the vision tokens, an image-only Qwen2-VL processor at Qwen3-VL's patches
    (16 px, merged 2 x 2: a 32 x 32 px image is one image token) and a Wan VAE of one level (2 px a latent pixel, 16
    latent channels: 32 px are 8 x 8 tokens; `MeanEncodingWanVAE`)."""
    tokenizer = write_qwen_tokenizer(folder / "qwen")
    vision_tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": [*vision_tokens, "<|im_start|>", "<|im_end|>"]})
    start, image, end, video = tokenizer.convert_tokens_to_ids(vision_tokens)
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                rope_parameters=rope)  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                  deepstack_visual_indexes=[], num_position_embeddings=16, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2)  # fmt: skip
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end)  # fmt: skip
    torch.manual_seed(0)
    text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    vae = MeanEncodingWanVAE(
        base_dim=3, z_dim=16, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False], scale_factor_spatial=2,
        scale_factor_temporal=1, latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
    ).eval()  # fmt: skip
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer),
    )


def tiny_joyimage_pipeline(folder: Path) -> JoyImageEditPipeline:
    """JoyImage-Edit's pipeline, random weights (`_joyimage_parts`, `tiny_joyimage`): it edits a 32 x 32 px image,
    encoded by the VAE as the reference item and shown to the text encoder with the prompt."""
    pipe = JoyImageEditPipeline(transformer=tiny_joyimage(), **_joyimage_parts(folder))
    pipe.vae_image_processor = GivenSizeImageProcessor(vae_scale_factor=pipe.vae_scale_factor_spatial)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_joyimage_plus_pipeline(folder: Path) -> JoyImageEditPlusPipeline:
    """JoyImage-Edit Plus's pipeline, random weights: two reference images of their own sizes (32 x 32 and 16 x 32
    px: 8 x 8 and 4 x 8 tokens after the generated image's 8 x 8), both guidance branches in one batch."""
    pipe = JoyImageEditPlusPipeline(transformer=tiny_joyimage_plus(), **_joyimage_parts(folder))
    pipe.image_processor = GivenSizeImageProcessor(vae_scale_factor=pipe.vae_scale_factor_spatial)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _wan_vae(latent: int = 4) -> AutoencoderKLWan:
    """A tiny Wan 2.1 VAE (8 px a latent pixel, 4 frames a latent frame), as `test_video.tiny_wan_pipeline`'s."""
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=3, z_dim=latent, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * latent, latents_std=[1.0] * latent,
    ).eval()  # fmt: skip


def tiny_motif_video_pipeline(folder: Path) -> MotifVideoPipeline:
    """Motif-Video's text-to-video pipeline, random weights: T5Gemma 2's encoder (one text layer 16 wide; its vision
    tower unused by prompts), a T5 tokenizer, the tiny Wan VAE (4 latent channels: `tiny_motif_video(4, 16)`) and
    classifier-free guidance through the guider, one call per branch."""
    tokenizer = write_t5_tokenizer(folder / "t5")
    vocab = len(tokenizer)  # then the image's begin, end and placeholder tokens
    text = dict(vocab_size=vocab + 3, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, dropout_rate=0.0)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4)  # fmt: skip
    config = T5Gemma2EncoderConfig(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=vocab, eoi_token_index=vocab + 1,
        image_token_index=vocab + 2,
    )  # fmt: skip
    torch.manual_seed(0)
    text_encoder = T5Gemma2Encoder(config, eoi_token_index=vocab + 1).eval()
    pipe = MotifVideoPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_wan_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_motif_video(4, 16),
        guider=ClassifierFreeGuidance(guidance_scale=3.0),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_anyflow_pipeline(folder: Path) -> AnyFlowPipeline:
    """AnyFlow's pipeline, random weights: the tiny Wan pipeline's UMT5 encoder and T5 tokenizer (text 16 wide), the
    tiny Wan VAE and `tiny_anyflow`; both guidance branches in one batch."""
    from test_video import tiny_wan_pipeline

    wan = tiny_wan_pipeline(folder)
    pipe = AnyFlowPipeline(
        tokenizer=wan.tokenizer,
        text_encoder=wan.text_encoder,
        transformer=tiny_anyflow(),
        vae=wan.vae,
        scheduler=FlowMapEulerDiscreteScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


_IMAGE = dict(height=SIDE, width=SIDE, num_inference_steps=2, guidance_scale=3.0, output_type="pt")
_VIDEO = dict(prompt="a cat walks", negative_prompt="blurry", height=SIDE, width=SIDE, num_frames=FRAMES,
              num_inference_steps=2, max_sequence_length=16, output_type="np")  # fmt: skip

CASES = (
    # The generated image's 6 x 8 tokens merge in both blocks; the reference's 48 pass through.
    FamilyCase("joyimage_edit", "joyimage_edit", tiny_joyimage, joyimage_inputs, merged_calls=2,
               pipeline=PipelineCase(tiny_joyimage_pipeline, dict(_IMAGE, image=picture(), prompt="make it red",
                                     negative_prompt="dark"), SIDE, SIDE)),
    # The text rotated too (its table passes as it is).
    FamilyCase("joyimage_edit_mrope", "joyimage_edit", lambda: tiny_joyimage("mrope"), joyimage_inputs,
               merged_calls=2),
    # References of two sizes, padded, and the mask over padding patches and text padding (cut).
    FamilyCase("joyimage_edit_plus", "joyimage_edit_plus", tiny_joyimage_plus, joyimage_plus_inputs, merged_calls=2,
               pipeline=PipelineCase(tiny_joyimage_plus_pipeline, dict(_IMAGE, images=[picture(), picture(16, 32, 1)],
                                     prompt="put them together", negative_prompt="dark"), SIDE, SIDE)),
    FamilyCase("omnigen", "omnigen", tiny_omnigen, omnigen_inputs, merged_calls=2, set_attn_processor=False),
    # A 2 x 2 input image's tokens in the prompt: rows of their own.
    FamilyCase("omnigen_edit", "omnigen", tiny_omnigen, lambda batch=2: omnigen_inputs(batch, reference=(2, 2)),
               merged_calls=2, set_attn_processor=False, batch_independent=False,
               why_not_independent="input_image_sizes numbers samples, which a slice of the batch does not renumber"),
    # The double-stream, the single-stream and the decoder block (the shared cross-attention is not merged).
    FamilyCase("motif_video", "motif_video", tiny_motif_video, motif_video_inputs, merged_calls=3,
               pipeline=PipelineCase(tiny_motif_video_pipeline, _VIDEO, SIDE, SIDE, FRAMES)),
    FamilyCase("anyflow", "anyflow", tiny_anyflow, anyflow_inputs, merged_calls=2, set_attn_processor=False,
               pipeline=PipelineCase(tiny_anyflow_pipeline, dict(_VIDEO, guidance_scale=3.0), SIDE, SIDE, FRAMES)),
    FamilyCase("dreamlite", "dreamlite", tiny_dreamlite, dreamlite_inputs, merged_calls=2, set_attn_processor=False),
)  # fmt: skip
