"""The FLUX-like successors (`families/fluxlike.py`): Krea 2, FLUX.3 and LongCat-Image (and -Edit's reference image).

Tiny random-weight models: diffusers' own test configs where they exist (Krea 2; LongCat-Image with 64 input
channels, as its pipeline packs 16 latent channels), FLUX.2's tiny sizes for FLUX.3 (no test, no pipeline yet).
Inputs as the pipelines build them (FLUX.3's as its forward's docstring and FLUX.2's pipeline build ids): batch 2,
a 6 x 8 token grid and 7 text tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    Flux3Transformer2DModel,
    Krea2Pipeline,
    Krea2Transformer2DModel,
    LongCatImagePipeline,
    LongCatImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLModel

from family_cases import FamilyCase, PipelineCase
from test_new_families import tiny_flow_vae, write_qwen_tokenizer

TEXT, H, W = 7, 6, 8
#: LongCat-Image's pipelines put the image's rows and columns after the text's 512 positions.
LONGCAT_START = 512


def grid_ids(h: int, w: int, columns: int, start: int = 0, time: float = 0.0) -> torch.Tensor:
    """Ids of a row-major `h x w` grid: the time coordinate in column 0, rows in 1 and columns in 2 (from `start`)."""
    out = torch.zeros(h, w, columns)
    out[..., 0] = time
    out[..., 1] = torch.arange(h)[:, None] + start
    out[..., 2] = torch.arange(w)[None] + start
    return out.view(h * w, columns)


# ---------------------------------------------------------------- Krea 2


def tiny_krea2(in_channels: int = 16, text_dim: int = 16, text_layers: int = 3) -> Krea2Transformer2DModel:
    """diffusers' test config of `Krea2Transformer2DModel`: 2 blocks of 4 query and 2 key/value heads of 8."""
    torch.manual_seed(0)
    return Krea2Transformer2DModel(
        in_channels=in_channels, num_layers=2, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=text_dim, num_text_layers=text_layers,
        text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=16,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2),
    ).eval()  # fmt: skip


def krea2_inputs(batch: int = 2) -> dict:
    """As `Krea2Pipeline` calls the model: the text's tapped layers, `position_ids` over text then image (the text's
    rows zero), timestep `t / 1000` and the prompt's mask (the second prompt's last two tokens padding)."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, TEXT, dtype=torch.bool)
    mask[1:, -2:] = False
    return {
        "hidden_states": torch.randn(batch, H * W, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 3, 16, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "position_ids": torch.cat([torch.zeros(TEXT, 3), grid_ids(H, W, 3)]),
        "encoder_attention_mask": mask,
    }


def tiny_krea2_pipeline(folder: Path) -> Krea2Pipeline:
    """Krea 2's pipeline, random weights: Qwen3-VL of one text layer (its embeddings and that layer tapped), the
    two-level Qwen-Image VAE (4 px a latent pixel: 32 px are 4 x 4 tokens) and `tiny_krea2` at that width. Its
    prompt template is a short one of the same shape: the prompt padded to `max_sequence_length` in the middle, the
    suffix after the padding, the prefix cropped."""
    tokenizer = write_qwen_tokenizer(folder / "qwen")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                rope_parameters=rope)  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                  deepstack_visual_indexes=[], num_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    text_encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision)).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=6400)  # fmt: skip
    pipe = Krea2Pipeline(
        scheduler, vae, text_encoder, tokenizer, tiny_krea2(in_channels=16, text_layers=2),
        text_encoder_select_layers=(0, 1),
    )  # fmt: skip
    pipe.prompt_template_encode_prefix = "<|im_start|>system\nDraw.<|im_end|>\n<|im_start|>user\n"
    pipe.prompt_template_encode_suffix = "<|im_end|>\n<|im_start|>assistant\n"
    pipe.prompt_template_encode_start_idx = len(tokenizer(pipe.prompt_template_encode_prefix).input_ids)
    pipe.prompt_template_encode_num_suffix_tokens = len(tokenizer(pipe.prompt_template_encode_suffix).input_ids)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- FLUX.3


def tiny_flux3() -> Flux3Transformer2DModel:
    """FLUX.2's tiny sizes: one per-mode block per mode, 2 single-stream blocks, 2 heads of 16."""
    torch.manual_seed(0)
    return Flux3Transformer2DModel(
        in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4),
    ).eval()  # fmt: skip


def flux3_inputs(batch: int = 2, reference: tuple[int, int] | None = None) -> dict:
    """As its forward's docstring asks, ids as FLUX.2's pipeline builds them (`(t, h, w, l)`; the text's numbered
    along `l`); with `reference`, a reference image's tokens and ids (time coordinate 10)."""
    generator = torch.Generator().manual_seed(0)
    text_ids = torch.zeros(TEXT, 4)
    text_ids[:, 3] = torch.arange(TEXT)
    inputs = {
        "hidden_states": torch.randn(batch, H * W, 8, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "img_ids": grid_ids(H, W, 4),
        "txt_ids": text_ids,
    }
    if reference is not None:
        inputs["image_cond_hidden_states"] = torch.randn(batch, reference[0] * reference[1], 8, generator=generator)
        inputs["image_cond_ids"] = grid_ids(*reference, 4, time=10.0)
    return inputs


# ---------------------------------------------------------------- LongCat-Image


def tiny_longcat(joint_attention_dim: int = 32) -> LongCatImageTransformer2DModel:
    """diffusers' test config of `LongCatImageTransformer2DModel` with 64 input channels (its pipelines pack 16
    latent channels) and 2 single-stream blocks."""
    torch.manual_seed(0)
    return LongCatImageTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=joint_attention_dim, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).eval()  # fmt: skip


def longcat_inputs(batch: int = 2, reference: bool = False) -> dict:
    """As `LongCatImagePipeline` calls the model: text ids `(0, i, i)`, image ids `(1, 512 + row, 512 + column)`;
    with `reference`, LongCat-Image-Edit's: the image to edit's tokens after the generated image's, at the same rows
    and columns and time coordinate 2."""
    generator = torch.Generator().manual_seed(0)
    text_ids = torch.zeros(TEXT, 3)
    text_ids[:, 1] = text_ids[:, 2] = torch.arange(TEXT)
    image_ids = grid_ids(H, W, 3, start=LONGCAT_START, time=1.0)
    if reference:
        image_ids = torch.cat([image_ids, grid_ids(H, W, 3, start=LONGCAT_START, time=2.0)])
    return {
        "hidden_states": torch.randn(batch, image_ids.shape[0], 64, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 32, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "img_ids": image_ids,
        "txt_ids": text_ids,
    }


def tiny_longcat_pipeline(folder: Path) -> LongCatImagePipeline:
    """LongCat-Image's pipeline, random weights: Qwen2.5-VL of one layer, a one-level 16-channel VAE (2 px a latent
    pixel: 32 px are 8 x 8 tokens) and `tiny_longcat`. The prompt is padded to the pipeline's 512 tokens. Its
    `text_processor` serves only prompt rewriting (`enable_prompt_rewrite`, which generates text with the
    encoder), turned off in the call: none is given."""
    tokenizer = write_qwen_tokenizer(folder / "qwen")
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}}
    text |= {"vocab_size": len(tokenizer)}  # (its logits over the prompt are computed, though unused)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, hidden_size=16, vocab_size=len(tokenizer),
        vision_end_token_id=len(tokenizer), vision_start_token_id=len(tokenizer), vision_token_id=len(tokenizer),
    )  # fmt: skip
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    pipe = LongCatImagePipeline(scheduler, tiny_flow_vae(16), text_encoder, tokenizer, None, tiny_longcat(16))
    pipe.set_progress_bar_config(disable=True)
    return pipe


CASES = (
    # 2 single-stream blocks (the text fusion's attention, over the text alone, is not merged).
    FamilyCase("krea2", "krea2", tiny_krea2, krea2_inputs, merged_calls=2,
               pipeline=PipelineCase(tiny_krea2_pipeline, dict(prompt="a cat", negative_prompt="dark",
                                     guidance_scale=2.0, max_sequence_length=16, num_inference_steps=2, height=32,
                                     width=32, output_type="pt"), 32, 32)),
    # The image's per-mode block and 2 single-stream blocks (the text's per-mode block is not merged).
    FamilyCase("flux3", "flux3", tiny_flux3, flux3_inputs, merged_calls=3),
    # The same, a 4 x 4 reference image's tokens passed through (its per-mode block is not merged).
    FamilyCase("flux3_reference", "flux3", tiny_flux3, lambda batch=2: flux3_inputs(batch, reference=(4, 4)),
               merged_calls=3),
    # One double- and 2 single-stream blocks.
    FamilyCase("longcat_image", "longcat_image", tiny_longcat, longcat_inputs, merged_calls=3,
               pipeline=PipelineCase(tiny_longcat_pipeline, dict(prompt="a cat", negative_prompt="dark",
                                     guidance_scale=2.0, num_inference_steps=2, height=32, width=32,
                                     output_type="pt", enable_prompt_rewrite=False), 32, 32)),
    # LongCat-Image-Edit's input: the reference image's tokens after the generated image's, never merged.
    FamilyCase("longcat_image_edit", "longcat_image", tiny_longcat, lambda batch=2: longcat_inputs(batch, True),
               merged_calls=3),
)  # fmt: skip
