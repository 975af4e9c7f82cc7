"""Sana (text-to-image, and Sana-Sprint's guidance-embedded models) and Sana-Video (text- and image-to-video) for the
family table: tiny random-weight models called as their pipelines call them, and tiny offline pipelines (SanaPipeline,
SanaSprintPipeline, SanaVideoPipeline).

Every model has 2 blocks; at ratio 0.5 only each block's linear self-attention merges (`merge_crossattn` is off, the
Mix-FFN is never merged), so each forward has 2 merged attention calls. Linear attention runs no
`scaled_dot_product_attention`: the table counts its calls from the tokens its query and key projections get
(`FamilyCase.linear_attentions`). Sana's latent is `(B, C, 6, 8)` at patch 1, Sana-Video's `(B, C, 2, 12, 16)` at
patch `(1, 2, 2)`: a 6 x 8 token grid (per frame); the text is 7 tokens, the second prompt's last 2 masked as padding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderDC,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    SanaPipeline,
    SanaSprintPipeline,
    SanaTransformer2DModel,
    SanaVideoPipeline,
    SanaVideoTransformer3DModel,
    SCMScheduler,
)
from transformers import Gemma2Config, Gemma2Model

from . import FamilyCase, PipelineCase
from test_ltx2 import write_gemma_tokenizer

TEXT_DIM, TEXT = 8, 7  # Gemma-2's width here; the text: 7 tokens (an off-by-text error shows)
H, W, FRAMES = 6, 8, 2  # the token grid, and Sana-Video's latent frames
MERGED_CALLS = 2  # each of the 2 blocks' linear self-attention


def linear_attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each block's linear self-attention (`attn1`): no SDPA kernel, counted by its projections."""
    return [block.attn1 for block in model.transformer_blocks]


def tiny_sana(sprint: bool = False) -> SanaTransformer2DModel:
    """diffusers' test-size Sana (2 heads x 4, 4 latent channels, patch 1) with 2 blocks; with `sprint`, as Sana-Sprint
    is configured: the guidance embedding and RMS-normed queries and keys."""
    torch.manual_seed(0)
    extra = dict(guidance_embeds=True, qk_norm="rms_norm_across_heads") if sprint else {}
    return SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=TEXT_DIM,
        sample_size=32, **extra,
    ).eval()  # fmt: skip


def _text(batch: int, g: torch.Generator) -> dict:
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[1:, -2:] = 0  # the pipelines pad each prompt to the longest and mask the padding
    return {"encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g), "encoder_attention_mask": mask}


def sana_inputs(batch: int = 2, sprint: bool = False) -> dict:
    """One forward as SanaPipeline makes it (the scheduler's 0..1000); with `sprint`, as SanaSprintPipeline: TrigFlow's
    time mapped to 0..1 and the guidance scale."""
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(batch, 4, H, W, generator=g), **_text(batch, g)}
    if sprint:
        return inputs | {"timestep": torch.full((batch,), 0.75), "guidance": torch.full((batch,), 4.5)}
    return inputs | {"timestep": torch.full((batch,), 750.0)}


def tiny_sana_video() -> SanaVideoTransformer3DModel:
    """diffusers' test-size Sana-Video (2 heads x 12, 3-D rotary axes 4 + 4 + 4, patch (1, 2, 2)), with 4 latent
    channels."""
    torch.manual_seed(0)
    return SanaVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=TEXT_DIM,
        mlp_ratio=2.5, sample_size=8, patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()  # fmt: skip


def sana_video_inputs(batch: int = 2, image: bool = False) -> dict:
    """One forward as SanaVideoPipeline makes it; with `image`, as SanaImageToVideoPipeline: one timestep per token,
    0 on the first (conditioning) frame's."""
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(batch, 4, FRAMES, 2 * H, 2 * W, generator=g), **_text(batch, g)}
    timestep = torch.full((batch,), 750.0)
    if image:
        timestep = torch.full((batch, 1, FRAMES, H, W), 750.0)
        timestep[:, :, 0] = 0.0
    return inputs | {"timestep": timestep}


# ---------------------------------------------------------------- pipelines (tiny, offline)


def _gemma(folder: Path) -> dict:
    """The pipelines' text side, random weights: Gemma 2 (one layer, 8 wide) over a letter tokenizer."""
    tokenizer = write_gemma_tokenizer(folder / "gemma")
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        attn_implementation="eager",
    )  # fmt: skip
    return {"text_encoder": Gemma2Model(config).eval(), "tokenizer": tokenizer}


def _dc_ae() -> AutoencoderDC:
    """DC-AE, tiny (2x in space, as diffusers' pipeline tests build it): the calls stop at the latents, its factor is
    read."""
    torch.manual_seed(0)
    return AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407,
    ).eval()  # fmt: skip


def tiny_sana_pipeline(folder: Path) -> SanaPipeline:
    pipe = SanaPipeline(
        transformer=tiny_sana(), vae=_dc_ae(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **_gemma(folder)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sana_sprint_pipeline(folder: Path) -> SanaSprintPipeline:
    """Sana-Sprint's pipeline: TrigFlow's SCM scheduler, the guidance embedded (no classifier-free batch)."""
    pipe = SanaSprintPipeline(
        transformer=tiny_sana(sprint=True), vae=_dc_ae(), scheduler=SCMScheduler(), **_gemma(folder)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sana_video_pipeline(folder: Path) -> SanaVideoPipeline:
    """Text to video over Wan's VAE (8x in space, 4x in time; diffusers' test size, never run: the call stops at the
    latents)."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    pipe = SanaVideoPipeline(
        transformer=tiny_sana_video(), vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=8.0), **_gemma(folder)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: One call of the image pipelines: 32 x 64 px (a 16 x 32 latent through the tiny DC-AE's 2x, patch 1), two steps
#: (with classifier-free guidance: one batch of both halves), up to the latents.
IMAGE_CALL = {
    "prompt": "a cat walks",
    "negative_prompt": "dark",
    "height": 32,
    "width": 64,
    "num_inference_steps": 2,
    "guidance_scale": 4.5,
    "max_sequence_length": 16,
    "complex_human_instruction": None,
    "use_resolution_binning": False,
    "output_type": "latent",
}
SPRINT_CALL = {key: value for key, value in IMAGE_CALL.items() if key != "negative_prompt"}
#: 5 frames (2 latent frames) of 96 x 128 px: a 6 x 8 token grid per frame.
VIDEO_CALL = {**IMAGE_CALL, "height": 8 * 2 * H, "width": 8 * 2 * W, "frames": 5}


CASES = (
    FamilyCase(
        name="sana",
        family="sana",
        build=tiny_sana,
        inputs=sana_inputs,
        merged_calls=MERGED_CALLS,
        linear_attentions=linear_attentions,
        pipeline=PipelineCase(tiny_sana_pipeline, IMAGE_CALL, 32, 64),
    ),
    FamilyCase(
        name="sana-sprint",
        family="sana",
        build=lambda: tiny_sana(sprint=True),
        inputs=lambda batch=2: sana_inputs(batch, sprint=True),
        merged_calls=MERGED_CALLS,
        linear_attentions=linear_attentions,
        pipeline=PipelineCase(tiny_sana_sprint_pipeline, SPRINT_CALL, 32, 64),
    ),
    FamilyCase(
        name="sana_video",
        family="sana_video",
        build=tiny_sana_video,
        inputs=sana_video_inputs,
        merged_calls=MERGED_CALLS,
        linear_attentions=linear_attentions,
        pipeline=PipelineCase(tiny_sana_video_pipeline, VIDEO_CALL, 8 * 2 * H, 8 * 2 * W, num_frames=5),
    ),
    FamilyCase(
        name="sana_video-i2v",
        family="sana_video",
        build=tiny_sana_video,
        inputs=lambda batch=2: sana_video_inputs(batch, image=True),
        merged_calls=MERGED_CALLS,
        linear_attentions=linear_attentions,
    ),
)
