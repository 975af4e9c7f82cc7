"""Cosmos, MiniMax-H3, Allegro, EasyAnimate, Latte and Mochi (`families/video_more.py`): tiny random-weight models,
inputs as their pipelines pass them, and tiny offline pipelines (no downloads; tokenizers written to the folder given).

Each grid is 2 frames of 6 x 8 tokens (a 12 x 16 latent over a 2 x 2 patch), the text 7 tokens. At 0.5 the
self-attention of each of the 2 blocks merges (Latte: its 2 spatial blocks, each over both frames as samples; Mochi:
its processor attends one sample at a time, so 2 calls a block); cross-attention, Latte's temporal blocks and
MiniMax-H3's text refiner keep every token. MiniMax-H3 has no pipeline
case: diffusers ships it as a modular pipeline only (`MiniMaxH3ModularPipeline`), which `enable_tome` (patched onto
`DiffusionPipeline`) and the table's pipeline checks do not take.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from diffusers import (
    AllegroPipeline,
    AllegroTransformer3DModel,
    AutoencoderKL,
    AutoencoderKLAllegro,
    AutoencoderKLMagvit,
    AutoencoderKLMochi,
    AutoencoderKLWan,
    CosmosTransformer3DModel,
    DDIMScheduler,
    EasyAnimatePipeline,
    EasyAnimateTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    LattePipeline,
    LatteTransformer3DModel,
    MiniMaxH3Transformer3DModel,
    MochiPipeline,
    MochiTransformer3DModel,
    UniPCMultistepScheduler,
)
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_utils import ModelMixin
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import Cosmos2_5_PredictBasePipeline
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
)

from tome_processors.bench.pipelines import write_t5_tokenizer

from family_cases import FamilyCase, PipelineCase

#: Latent frames, rows and columns of the model cases (2 x 6 x 8 tokens over a 2 x 2 patch) and prompt tokens.
FRAMES, LATENT_H, LATENT_W, TEXT = 2, 12, 16, 7


def _noise(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


# ---------------------------------------------------------------- Cosmos (Predict 2.5)

#: The tiny Cosmos's latent channels (the Wan VAE's 16) and text width; its prompt embedding is every layer of a
#: one-layer 16-wide text encoder, projected to the cross-attention's width as Predict 2.5 does.
COSMOS_LATENT, COSMOS_TEXT = 16, 16


def tiny_cosmos() -> CosmosTransformer3DModel:
    """diffusers' own test config in Predict 2.5's shape (a condition-mask channel, no learnable position embedding,
    the text projected in), without the padding-mask channel: its resize needs torchvision."""
    torch.manual_seed(0)
    return CosmosTransformer3DModel(
        in_channels=COSMOS_LATENT + 1,
        out_channels=COSMOS_LATENT,
        num_attention_heads=2,
        attention_head_dim=12,
        num_layers=2,
        mlp_ratio=2,
        text_embed_dim=16,
        adaln_lora_dim=4,
        max_size=(4, 32, 32),
        patch_size=(1, 2, 2),
        rope_scale=(1.0, 3.0, 3.0),
        concat_padding_mask=False,
        extra_pos_embed_type=None,
        use_crossattn_projection=True,
        crossattn_proj_in_channels=COSMOS_TEXT,
        encoder_hidden_states_channels=16,
    ).eval()


def cosmos_inputs(batch: int = 2, frames: int = FRAMES, h: int = LATENT_H, w: int = LATENT_W) -> dict:
    """As `Cosmos2_5_PredictBasePipeline` calls the model in image-to-world: the first latent frame the condition
    (its mask 1, its timestep nearly clean), the others at the step's sigma, a timestep per latent frame."""
    g = torch.Generator().manual_seed(0)
    condition = torch.zeros(batch, 1, frames, 1, 1)
    condition[:, :, 0] = 1.0
    sigma = torch.tensor([0.7, 0.4])[:batch].view(batch, 1, 1, 1, 1)
    return {
        "hidden_states": _noise(batch, COSMOS_LATENT, frames, h, w, g=g),
        "condition_mask": condition.expand(-1, -1, -1, h, w).contiguous(),
        "timestep": condition * 1e-4 + (1 - condition) * sigma,
        "encoder_hidden_states": _noise(batch, TEXT, COSMOS_TEXT, g=g),
        "padding_mask": torch.zeros(1, 1, 8 * h, 8 * w),
    }


class NoGuardrail(ModelMixin, ConfigMixin):
    """Stands in for Cosmos Guardrail (`cosmos_guardrail`, not installed): passes every prompt and video. A buffer
    tells the pipeline its device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("device_marker", torch.zeros(1), persistent=False)

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames: np.ndarray) -> np.ndarray:
        return frames


def _qwen_tokenizer(folder: Path):
    from test_new_families import write_qwen_tokenizer

    tokenizer = write_qwen_tokenizer(folder)
    # The pipelines send messages whose content is a list of parts; their text is what is tokenized.
    tokenizer.chat_template = (
        "{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
    )
    return tokenizer


def cosmos_pipeline(folder: Path) -> Cosmos2_5_PredictBasePipeline:
    """Predict 2.5's pipeline: a one-layer Qwen2.5-VL (every hidden layer after the embedding, normalized and
    concatenated: 16 channels), diffusers' tiny Wan VAE (16 latent channels, 8 x 8 pixels and 4 frames a latent pixel)
    and the flow UniPC scheduler."""
    tokenizer = _qwen_tokenizer(folder / "qwen")
    torch.manual_seed(0)
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, hidden_size=16, vocab_size=len(tokenizer),
        vision_end_token_id=0, vision_start_token_id=1, vision_token_id=2,
    )  # fmt: skip
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=COSMOS_LATENT,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()
    scheduler = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=5.0)
    pipe = Cosmos2_5_PredictBasePipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_cosmos(),
        vae=vae,
        scheduler=scheduler,
        safety_checker=NoGuardrail(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- MiniMax-H3

#: The tiny MiniMax-H3's video and audio channels and text width (diffusers' own test config), and its soundtrack:
#: 3 latents on each of the 2 channels.
MINIMAX_LATENT, MINIMAX_AUDIO, MINIMAX_TEXT, AUDIO_LATENTS = 4, 6, 8, 3


def tiny_minimax_h3() -> MiniMaxH3Transformer3DModel:
    """diffusers' own test config: 2 heads of 16 over a 24-wide stream, 12 of the 16 head channels rotated."""
    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=24,
        num_layers=2,
        num_refiner_layers=2,
        ffn_dim=32,
        in_channels=MINIMAX_LATENT,
        audio_in_channels=MINIMAX_AUDIO,
        patch_size=(1, 2, 2),
        text_dim=MINIMAX_TEXT,
        freq_dim=8,
        time_embed_hidden_dim=24,
        time_embed_dim=16,
        rope_freq_dim=2,
    ).eval()


def minimax_h3_inputs(
    batch: int = 2,
    frames: int = FRAMES,
    h: int = LATENT_H,
    w: int = LATENT_W,
    keyframes: tuple[str, ...] = ("first",),
    text: int = TEXT,
) -> dict:
    """As the fl2va (t2va without `keyframes`) denoising loop calls the model: the layout its layout step packs
    (`[text | keyframes | audio | video]`, `keyframes` a frame's rows each), the step's distinct row timesteps (video
    at t = 0.4, audio at 0.6, the keyframes at the pipeline's 0.999; one set for the whole batch) and the video rows
    patchified, the keyframes' first."""
    g = torch.Generator().manual_seed(0)
    positions, tags, video, audio, text_rows, conditions, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text, dtype=torch.long), frames, h, w, AUDIO_LATENTS, (1, 2, 2), 2, 2, 0, keyframes
    )
    timestep, rows = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, conditions, 0, text, 0.4, 0.6, 0.999, 1.0
    )
    return {
        "hidden_states": _noise(batch, video.numel(), 4 * MINIMAX_LATENT, g=g),
        "audio_hidden_states": _noise(batch, audio.numel(), MINIMAX_AUDIO, g=g),
        "encoder_hidden_states": _noise(batch, text, MINIMAX_TEXT, g=g),
        "timestep": timestep,
        "timestep_indices": rows,
        "token_tags": tags,
        "position_ids": positions,
        "video_indices": video,
        "audio_indices": audio,
        "text_indices": text_rows,
    }


# ---------------------------------------------------------------- Allegro


def tiny_allegro(num_layers: int = 2) -> AllegroTransformer3DModel:
    """diffusers' own test config: 2 heads of 12 (4 rotary channels per axis), 24-wide text."""
    torch.manual_seed(0)
    return AllegroTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        num_layers=num_layers,
        cross_attention_dim=24,
        sample_width=8,
        sample_height=8,
        sample_frames=8,
        caption_channels=24,
    ).eval()


def allegro_rotary(model: AllegroTransformer3DModel, frames: int, h: int, w: int) -> tuple:
    """The rotary tables and positions `AllegroPipeline` makes for `frames` latent frames of `h x w` latent pixels
    (its own method, on the model's config)."""
    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    return AllegroPipeline._prepare_rotary_positional_embeddings(pipe, 1, 8 * h, 8 * w, frames, "cpu")


def allegro_inputs(batch: int = 2, frames: int = FRAMES, h: int = LATENT_H, w: int = LATENT_W) -> dict:
    """As `AllegroPipeline` calls the model: the scheduler's timestep, the prompt's mask (the second prompt
    padded), the rotary tables and positions for the whole batch."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, TEXT)
    mask[1:, -2:] = 0
    return {
        "hidden_states": _noise(batch, 4, frames, h, w, g=g),
        "encoder_hidden_states": _noise(batch, TEXT, 24, g=g),
        "encoder_attention_mask": mask,
        "timestep": torch.full((batch,), 500.0),
        "image_rotary_emb": allegro_rotary(tiny_allegro(1), frames, h, w),
    }


def _t5(folder: Path, width: int) -> tuple:
    tokenizer = write_t5_tokenizer(folder / "t5")
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(tokenizer), d_model=width, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return tokenizer, T5EncoderModel(config).eval()


def allegro_pipeline(folder: Path) -> AllegroPipeline:
    """Allegro's pipeline: a one-layer T5, diffusers' tiny Allegro VAE (tiled, as its tests decode) and DDIM."""
    tokenizer, text_encoder = _t5(folder, 24)
    torch.manual_seed(0)
    vae = AutoencoderKLAllegro(
        in_channels=3, out_channels=3, down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
    ).eval()  # fmt: skip
    vae.enable_tiling()
    pipe = AllegroPipeline(tokenizer, text_encoder, vae, tiny_allegro(), DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- EasyAnimate


def tiny_easyanimate() -> EasyAnimateTransformer3DModel:
    """diffusers' own test config with 2 heads of 16 (its 3-D rotary splits a head into 4 + 6 + 6 channels) and 2
    blocks, the second past `mmdit_layers` (no text projections of its own)."""
    torch.manual_seed(0)
    return EasyAnimateTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=16,
        num_layers=2,
        mmdit_layers=1,
        sample_width=16,
        sample_height=16,
        patch_size=2,
    ).eval()


def easyanimate_inputs(batch: int = 2, frames: int = FRAMES, h: int = LATENT_H, w: int = LATENT_W) -> dict:
    """As `EasyAnimatePipeline` calls the model: the flow-matching timestep per sample and the text embeddings."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": _noise(batch, 4, frames, h, w, g=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": _noise(batch, TEXT, 16, g=g),
    }


def easyanimate_pipeline(folder: Path) -> EasyAnimatePipeline:
    """EasyAnimate's pipeline: a one-layer Qwen2-VL (its second-to-last hidden states: 16 channels), diffusers' tiny
    MagViT VAE and flow matching."""
    tokenizer = _qwen_tokenizer(folder / "qwen")
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=len(tokenizer), rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2},
        vision_end_token_id=0, vision_start_token_id=1, vision_token_id=2, image_token_id=3, video_token_id=4,
    )  # fmt: skip
    text_encoder = Qwen2VLForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLMagvit(
        in_channels=3, out_channels=3,
        down_block_types=("SpatialDownBlock3D",) + ("SpatialTemporalDownBlock3D",) * 3,
        up_block_types=("SpatialUpBlock3D",) + ("SpatialTemporalUpBlock3D",) * 3,
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
        spatial_group_norm=False,
    ).eval()  # fmt: skip
    pipe = EasyAnimatePipeline(vae, text_encoder, tokenizer, tiny_easyanimate(), FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- Latte


def tiny_latte(frames: int = FRAMES) -> LatteTransformer3DModel:
    """diffusers' own test config (PixArt-α's blocks, 2 heads of 4), its temporal position embedding `frames` long
    (the clip's: Latte adds it to every clip)."""
    torch.manual_seed(0)
    return LatteTransformer3DModel(
        sample_size=8,
        num_layers=2,
        patch_size=2,
        attention_head_dim=4,
        num_attention_heads=2,
        caption_channels=8,
        in_channels=4,
        cross_attention_dim=8,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        video_length=frames,
    ).eval()


def latte_inputs(batch: int = 2, frames: int = FRAMES, h: int = LATENT_H, w: int = LATENT_W) -> dict:
    """As `LattePipeline` calls the model: the scheduler's timestep, the prompt's tokens (cut to its length)."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": _noise(batch, 4, frames, h, w, g=g),
        "encoder_hidden_states": _noise(batch, TEXT, 8, g=g),
        "timestep": torch.full((batch,), 500.0),
        "enable_temporal_attentions": True,
    }


def latte_pipeline(folder: Path) -> LattePipeline:
    """Latte's pipeline: a one-layer T5, a two-level VAE (2 pixels a latent pixel) and DDIM."""
    tokenizer, text_encoder = _t5(folder, 8)
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4, norm_num_groups=8,
        sample_size=32,
    ).eval()  # fmt: skip
    pipe = LattePipeline(tokenizer, text_encoder, vae, tiny_latte(), DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- Mochi


def tiny_mochi(in_channels: int = 4, text: int = 16) -> MochiTransformer3DModel:
    """diffusers' own test config: 2 blocks of 2 heads x 8 (the last `context_pre_only`), a 16-wide text stream; its
    rotary frequencies random (the released model's are learned; zeros would rotate nothing)."""
    torch.manual_seed(0)
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=in_channels, text_embed_dim=text, time_embed_dim=4, max_sequence_length=16,
    )  # fmt: skip
    with torch.no_grad():
        model.pos_frequencies.normal_(0.0, 0.5)
    return model.eval()


def mochi_inputs(batch: int = 2, frames: int = FRAMES, h: int = LATENT_H, w: int = LATENT_W) -> dict:
    """As `MochiPipeline` calls the model: T5's prompt and its boolean mask (the second prompt padded), the timestep
    `1000 (1 - sigma)` (its scheduler's `invert_sigmas`) per sample."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, TEXT, dtype=torch.bool)
    mask[1:, -2:] = False
    return {
        "hidden_states": _noise(batch, 4, frames, h, w, g=g),
        "encoder_hidden_states": _noise(batch, TEXT, 16, g=g),
        "timestep": torch.full((batch,), 250.0),
        "encoder_attention_mask": mask,
    }


def mochi_pipeline(folder: Path) -> MochiPipeline:
    """Mochi's pipeline: a one-layer T5, diffusers' tiny Mochi VAE (its 12 latent channels, which the pipeline's
    latent statistics need) and flow matching with inverted sigmas (the released scheduler's)."""
    tokenizer, text_encoder = _t5(folder, 16)
    torch.manual_seed(0)
    vae = AutoencoderKLMochi(
        latent_channels=12, out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
    ).eval()  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    pipe = MochiPipeline(scheduler, vae, text_encoder, tokenizer, tiny_mochi(in_channels=12))
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: 32 x 32 px clips of 5 frames (2 latent frames of 2 x 2 tokens; Latte: 2 frames of 8 x 8 tokens; Mochi: 7 frames,
#: its VAE's 6 a latent frame after the first).
SIDE, CLIP, MOCHI_CLIP = 32, 5, 7

CASES = (
    FamilyCase(
        name="cosmos",
        family="cosmos",
        build=tiny_cosmos,
        inputs=cosmos_inputs,
        merged_calls=2,  # attn1 of the 2 blocks; attn2 (the text) keeps its queries
        set_attn_processor=False,
        pipeline=PipelineCase(
            build=cosmos_pipeline,
            call_kwargs=dict(
                prompt="a robot arm welds",
                negative_prompt="blurry",
                height=SIDE,
                width=SIDE,
                num_frames=CLIP,
                num_inference_steps=2,
                guidance_scale=3.0,
                max_sequence_length=16,
                output_type="pt",
            ),
            height=SIDE,
            width=SIDE,
            num_frames=CLIP,
        ),
    ),
    FamilyCase(
        name="minimax_h3",
        family="minimax_h3",
        build=tiny_minimax_h3,
        inputs=minimax_h3_inputs,
        merged_calls=2,  # attn of the 2 blocks (the video's 96 tokens after text, keyframe, audio); not the refiner's
    ),
    FamilyCase(
        name="allegro",
        family="allegro",
        build=tiny_allegro,
        inputs=allegro_inputs,
        merged_calls=2,  # attn1 of the 2 blocks
        set_attn_processor=False,
        pipeline=PipelineCase(
            build=allegro_pipeline,
            call_kwargs=dict(
                prompt="a cat walks",
                negative_prompt="",
                height=SIDE,
                width=SIDE,
                num_frames=CLIP,
                num_inference_steps=2,
                guidance_scale=6.0,
                max_sequence_length=16,
                clean_caption=False,
                output_type="latent",  # the tiny VAE decodes by tiles larger than the clip: a blank video
            ),
            height=SIDE,
            width=SIDE,
            num_frames=CLIP,
        ),
    ),
    FamilyCase(
        name="easyanimate",
        family="easyanimate",
        build=tiny_easyanimate,
        inputs=easyanimate_inputs,
        merged_calls=2,  # attn1 of the 2 blocks (the second concatenates the text itself)
        set_attn_processor=False,
        pipeline=PipelineCase(
            build=easyanimate_pipeline,
            call_kwargs=dict(
                prompt="a cat walks",
                negative_prompt="blurry",
                height=SIDE,
                width=SIDE,
                num_frames=CLIP,
                num_inference_steps=2,
                guidance_scale=6.0,
                output_type="pt",
            ),
            height=SIDE,
            width=SIDE,
            num_frames=CLIP,
        ),
    ),
    FamilyCase(
        name="latte",
        family="latte",
        build=tiny_latte,
        inputs=latte_inputs,
        merged_calls=2,  # attn1 of the 2 spatial blocks (both frames of both samples in one call); not the temporal
        set_attn_processor=False,
        pipeline=PipelineCase(
            build=latte_pipeline,
            call_kwargs=dict(
                prompt="a cat walks",
                negative_prompt="blurry",
                height=SIDE,
                width=SIDE,
                video_length=FRAMES,
                num_inference_steps=2,
                guidance_scale=5.0,
                clean_caption=False,
                output_type="pt",
            ),
            height=SIDE,
            width=SIDE,
            num_frames=FRAMES,
        ),
    ),
    FamilyCase(
        name="mochi",
        family="mochi",
        build=tiny_mochi,
        inputs=mochi_inputs,
        merged_calls=4,  # attn1 of the 2 blocks, one attention call per sample (its processor's); not the text pooler
        set_attn_processor=False,  # MochiTransformer3DModel has no set_attn_processor
        pipeline=PipelineCase(
            build=mochi_pipeline,
            call_kwargs=dict(
                prompt="a cat walks",
                negative_prompt="",
                height=SIDE,
                width=SIDE,
                num_frames=MOCHI_CLIP,
                num_inference_steps=2,
                guidance_scale=4.5,
                max_sequence_length=16,
                output_type="pt",
            ),
            height=SIDE,
            width=SIDE,
            num_frames=MOCHI_CLIP,
        ),
    ),
)
