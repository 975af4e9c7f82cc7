"""The CogVideoX lineage (`families/cog.py`): CogVideoX (5B's rotary positions, 2B's absolute ones, 1.5's two latent
frames a token), ConsisID, CogView 3 Plus and CogView 4. Tiny random-weight models, their inputs as their pipelines
pass them, and tiny offline pipelines (the T5 and byte-level tokenizers written to the folder given).

Each grid is 6 x 8 tokens a frame (a 12 x 16 latent over the 2 x 2 patch), the prompt 7 tokens. At 0.5 the joint
attention (`attn1`) of each of the 2 blocks merges: 2 calls a forward. The video models' rotary tables are built as
their pipelines build them (`get_3d_rotary_pos_embed` over the grid), CogView 4's by the model itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLCogVideoX,
    CogVideoXDDIMScheduler,
    CogVideoXDPMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    CogView3PlusPipeline,
    CogView3PlusTransformer2DModel,
    CogView4Pipeline,
    CogView4Transformer2DModel,
    ConsisIDPipeline,
    ConsisIDTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
)
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid
from diffusers.utils import is_opencv_available
from PIL import Image
from transformers import GlmConfig, GlmModel, T5Config, T5EncoderModel

from tome_processors.bench.pipelines import write_t5_tokenizer

from . import FamilyCase, PipelineCase

#: The prompt's tokens (not a multiple of anything, so an off-by-text error shows), the text encoders' width, the
#: latent channels, the heads and their width (3-D rotary: 4 + 6 + 6 channels of 16).
TEXT, TEXT_DIM, LATENT, HEADS, HEAD_DIM = 7, 16, 4, 2, 16
#: The token grid a frame (`H x W`) and the video models' latent frames.
H, W, FRAMES = 6, 8, 2
#: ConsisID's face inputs: the identity embedding's width, the face ViT's hidden width and tokens.
FACE_ID_DIM, FACE_VIT_DIM, FACE_VIT_TOKENS = 4, 4, 3


def video_rotary(
    h: int, w: int, frames: int, base: tuple[int, int] = (H, W), patch_size_t: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)` over a `frames x h x w` grid of tokens, as `CogVideoXPipeline._prepare_rotary_positional_embeddings`
    builds them: 1.0's over the crop of the grid in the model's base size (`base`: its `sample_height / sample_width`
    over the patch), 1.5's (`patch_size_t`) a slice of the base grid."""
    if patch_size_t is None:
        crops = get_resize_crop_region_for_grid((h, w), base[1], base[0])
        return get_3d_rotary_pos_embed(HEAD_DIM, crops, (h, w), frames)
    return get_3d_rotary_pos_embed(HEAD_DIM, None, (h, w), frames, grid_type="slice", max_size=base)


# ---------------------------------------------------------------- CogVideoX


def tiny_cogvideox(rotary: bool = True, patch_size_t: int | None = None, **config) -> CogVideoXTransformer3DModel:
    """diffusers' own test config (2 heads), 2 blocks: 5B's rotary positions (`rotary`), else 2B's absolute ones
    over the 7-token prompt and a 2-frame 12 x 16 latent (`sample_*`); `patch_size_t` 2: 1.5's."""
    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(
        **{
            **dict(
                num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=LATENT, out_channels=LATENT,
                time_embed_dim=8, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=2 * W, sample_height=2 * H,
                sample_frames=4 * (FRAMES - 1) + 1, patch_size=2, patch_size_t=patch_size_t,
                temporal_compression_ratio=4, max_text_seq_length=TEXT, use_rotary_positional_embeddings=rotary,
            ),
            **config,
        }
    ).eval()  # fmt: skip


def cogvideox_inputs(
    batch: int = 2, rotary: bool = True, patch_size_t: int | None = None, channels: int = LATENT
) -> dict:
    """As `CogVideoXPipeline` calls the model (both guidance halves in one batch): the latent frames first,
    `(B, F, C, 12, 16)` (`FRAMES` token frames: times `patch_size_t` latent frames on 1.5), the scheduler's timestep,
    the prompt and the pipeline's rotary tables (`rotary`; none on 2B)."""
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(batch, FRAMES * (patch_size_t or 1), channels, 2 * H, 2 * W, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 501, dtype=torch.long),
    }
    if rotary:
        inputs["image_rotary_emb"] = video_rotary(H, W, FRAMES, patch_size_t=patch_size_t)
    return inputs


def _cogvideox_vae() -> AutoencoderKLCogVideoX:
    """diffusers' pipeline-test VAE: 8 px and 4 frames a latent pixel, 4 latent channels."""
    torch.manual_seed(0)
    return AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=LATENT,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
    ).eval()  # fmt: skip


def _t5(folder: Path) -> tuple:
    """A T5 tokenizer written to `folder` and a tiny random T5 encoder of the models' text width."""
    tokenizer = write_t5_tokenizer(folder / "t5")
    torch.manual_seed(0)
    encoder = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    ).eval()
    return tokenizer, encoder


#: The video pipelines' clips: 32 x 32 px of 5 frames, 2 latent frames of 2 x 2 tokens; the prompt padded to 16.
SIDE, CLIP_FRAMES, PADDED = 32, 5, 16


def cogvideox_pipeline(folder: Path) -> CogVideoXPipeline:
    """CogVideoX 5B's pipeline, random weights: its rotary positions over the 2 x 2 tokens of the model's base size
    (`sample_height / sample_width`: 4 latent pixels), the prompt padded to 16 tokens."""
    tokenizer, text_encoder = _t5(folder)
    transformer = tiny_cogvideox(sample_width=SIDE // 8, sample_height=SIDE // 8, max_text_seq_length=PADDED)
    pipe = CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_cogvideox_vae(),
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- ConsisID


def tiny_consisid(**config) -> ConsisIDTransformer3DModel:
    """diffusers' own test config (its face branch: a local facial extractor and a perceiver cross-attention after
    each block), 2 blocks, the released model's rotary and learned positions, image-to-video's input (the noisy
    latent and the image's over channels)."""
    torch.manual_seed(0)
    shape = dict(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=2 * LATENT, out_channels=LATENT,
        time_embed_dim=8, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=2 * W, sample_height=2 * H,
        sample_frames=4 * (FRAMES - 1) + 1, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=TEXT,
        use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True, cross_attn_interval=1,
        is_kps=False, is_train_face=True, cross_attn_dim_head=4, cross_attn_num_heads=2, LFE_id_dim=FACE_ID_DIM,
        LFE_vit_dim=FACE_VIT_DIM, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=1,
        LFE_num_querie=2, LFE_output_dim=2 * HEADS * HEAD_DIM // 3, LFE_ff_mult=1, LFE_num_scale=1,
    )  # fmt: skip
    return ConsisIDTransformer3DModel(**{**shape, **config}).eval()


def consisid_inputs(batch: int = 2) -> dict:
    """As `ConsisIDPipeline` calls the model: CogVideoX's inputs with the image's latents over channels, and the
    face's identity embedding and ViT hidden states (one tensor a scale), one face for the whole batch (both guidance
    halves get the same)."""
    g = torch.Generator().manual_seed(1)
    return {
        **cogvideox_inputs(batch, channels=2 * LATENT),
        "id_cond": torch.randn(1, FACE_ID_DIM, generator=g),
        "id_vit_hidden": [torch.randn(1, FACE_VIT_TOKENS, FACE_VIT_DIM, generator=g)],
    }


def consisid_pipeline(folder: Path) -> ConsisIDPipeline:
    """ConsisID's pipeline, random weights: its learned positions at the call's 2 x 2 tokens (`sample_*`: 4 latent
    pixels, 5 frames), the prompt padded to 16 tokens."""
    tokenizer, text_encoder = _t5(folder)
    transformer = tiny_consisid(
        sample_width=SIDE // 8, sample_height=SIDE // 8, sample_frames=CLIP_FRAMES, max_text_seq_length=PADDED
    )
    pipe = ConsisIDPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_cogvideox_vae(),
        transformer=transformer,
        scheduler=CogVideoXDPMScheduler(timestep_spacing="trailing"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _picture(side: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


# ---------------------------------------------------------------- CogView 3 Plus and CogView 4


def tiny_cogview3plus() -> CogView3PlusTransformer2DModel:
    """diffusers' own test config, 2 heads of 8: absolute positions cropped from a 16 x 16 table."""
    torch.manual_seed(0)
    return CogView3PlusTransformer2DModel(
        patch_size=2, in_channels=LATENT, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        out_channels=LATENT, text_embed_dim=TEXT_DIM, time_embed_dim=8, condition_dim=2, pos_embed_max_size=16,
        sample_size=16,
    ).eval()  # fmt: skip


def tiny_cogview4() -> CogView4Transformer2DModel:
    """diffusers' own test config: 4 heads of 8 (2-D rotary: 4 + 4 channels)."""
    torch.manual_seed(0)
    return CogView4Transformer2DModel(
        patch_size=2, in_channels=LATENT, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        out_channels=LATENT, text_embed_dim=TEXT_DIM, time_embed_dim=8, condition_dim=4,
    ).eval()  # fmt: skip


def cogview_inputs(batch: int = 2, h: int = H, w: int = W) -> dict:
    """As the CogView pipelines call their models: the latent `(B, C, 2h, 2w)`, the scheduler's timestep (0..1000),
    the prompt, and SDXL's size conditions (the image's pixels, no crop)."""
    g = torch.Generator().manual_seed(0)
    size = torch.tensor([[16.0 * h, 16.0 * w]]).repeat(batch, 1)
    return {
        "hidden_states": torch.randn(batch, LATENT, 2 * h, 2 * w, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 750.0),
        "original_size": size,
        "target_size": size,
        "crop_coords": torch.zeros(batch, 2),
    }


def _image_vae() -> AutoencoderKL:
    """A two-level VAE (2 px a latent pixel), 4 latent channels: the pipelines' images decode fast."""
    from test_new_families import tiny_flow_vae

    return tiny_flow_vae(LATENT)


#: The image pipelines' size (CogView 4's sides are multiples of 16): 16 x 32 px over the 2x VAE, 4 x 8 tokens.
IMAGE_H, IMAGE_W = 16, 32


def cogview3plus_pipeline(folder: Path) -> CogView3PlusPipeline:
    """CogView 3 Plus's pipeline, random weights: T5 (the prompt padded to 16 tokens), both guidance halves in one
    batch."""
    tokenizer, text_encoder = _t5(folder)
    pipe = CogView3PlusPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_image_vae(),
        transformer=tiny_cogview3plus(),
        scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cogview4_pipeline(folder: Path) -> CogView4Pipeline:
    """CogView 4's pipeline, random weights: a tiny GLM over a byte-level tokenizer (the prompt left-padded to a
    multiple of 16), the flow-matching scheduler shifted by the image's tokens, a model call per guidance branch."""
    from test_new_families import write_qwen_tokenizer

    tokenizer = write_qwen_tokenizer(folder / "glm")
    torch.manual_seed(0)
    text_encoder = GlmModel(
        GlmConfig(vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, pad_token_id=tokenizer.pad_token_id)
    ).eval()  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    pipe = CogView4Pipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_image_vae(),
        transformer=tiny_cogview4(),
        scheduler=scheduler,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _video_call(**extra) -> dict:
    return dict(
        prompt="a cat walks", negative_prompt="blurry", height=SIDE, width=SIDE, num_frames=CLIP_FRAMES,
        num_inference_steps=2, guidance_scale=6.0, max_sequence_length=PADDED, output_type="latent", **extra,
    )  # fmt: skip


def _image_call(**extra) -> dict:
    return dict(
        prompt="a red fox", negative_prompt="blurry", height=IMAGE_H, width=IMAGE_W, num_inference_steps=2,
        guidance_scale=5.0, output_type="pt", **extra,
    )  # fmt: skip


_CONSISID_PIPELINE = PipelineCase(
    build=consisid_pipeline,
    call_kwargs=_video_call(
        image=_picture(SIDE),
        id_cond=torch.randn(1, FACE_ID_DIM, generator=torch.Generator().manual_seed(2)),
        id_vit_hidden=[torch.randn(1, FACE_VIT_TOKENS, FACE_VIT_DIM, generator=torch.Generator().manual_seed(3))],
    ),
    height=SIDE,
    width=SIDE,
    num_frames=CLIP_FRAMES,
)

CASES = (
    FamilyCase(
        name="cogvideox",
        family="cogvideox",
        build=tiny_cogvideox,
        inputs=cogvideox_inputs,
        merged_calls=2,  # attn1 of the 2 blocks (the prompt, then 2 frames of 6 x 8 tokens)
        pipeline=PipelineCase(
            build=cogvideox_pipeline, call_kwargs=_video_call(), height=SIDE, width=SIDE, num_frames=CLIP_FRAMES
        ),
    ),
    FamilyCase(
        name="cogvideox-2b",
        family="cogvideox",
        build=lambda: tiny_cogvideox(rotary=False),
        inputs=lambda batch=2: cogvideox_inputs(batch, rotary=False),
        merged_calls=2,  # attn1 of the 2 blocks; absolute positions, no rotary tables
    ),
    FamilyCase(
        name="cogvideox15",
        family="cogvideox",
        build=lambda: tiny_cogvideox(patch_size_t=2),
        inputs=lambda batch=2: cogvideox_inputs(batch, patch_size_t=2),
        merged_calls=2,  # attn1 of the 2 blocks (4 latent frames: 2 token frames of 6 x 8)
    ),
    FamilyCase(
        name="consisid",
        family="consisid",
        build=tiny_consisid,
        inputs=consisid_inputs,
        merged_calls=2,  # attn1 of the 2 blocks; the face branch's perceiver attention is no SDPA call, unmerged
        # diffusers offers ConsisIDPipeline only where OpenCV is installed (it draws face keypoints with it).
        pipeline=_CONSISID_PIPELINE if is_opencv_available() else None,
    ),
    FamilyCase(
        name="cogview3plus",
        family="cogview3plus",
        build=tiny_cogview3plus,
        inputs=cogview_inputs,
        merged_calls=2,  # attn1 of the 2 blocks
        pipeline=PipelineCase(
            build=cogview3plus_pipeline,
            call_kwargs=_image_call(max_sequence_length=PADDED),
            height=IMAGE_H,
            width=IMAGE_W,
        ),
    ),
    FamilyCase(
        name="cogview4",
        family="cogview4",
        build=tiny_cogview4,
        inputs=cogview_inputs,
        merged_calls=2,  # attn1 of the 2 blocks
        pipeline=PipelineCase(build=cogview4_pipeline, call_kwargs=_image_call(), height=IMAGE_H, width=IMAGE_W),
        set_attn_processor=False,  # CogView4Transformer2DModel has no set_attn_processor: apply_tome and enable_tome
    ),
)
