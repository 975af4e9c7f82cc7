"""Qwen-Image 2.1 (`QwenImage21Transformer2DModel`) and ERNIE-Image (`ErnieImageTransformer2DModel`): tiny models of
diffusers' own test configurations (two blocks), called as their pipelines call them, and tiny offline pipelines."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage21,
    ErnieImagePipeline,
    ErnieImageTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Mistral3Config, Mistral3Model, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from family_cases import FamilyCase, PipelineCase
from test_new_families import Qwen2VLImageProcessor, write_qwen_tokenizer

TEXT = 7  # text tokens: not a multiple of anything, so an off-by-text error shows
PADDED = 3  # prompt padding of the second sample, masked
#: Latent tokens per vision-language image slot in Qwen-Image 2.1's joint sequence (2 x 2).
SLOT = 4

# ---------------------------------------------------------------- Qwen-Image 2.1


def tiny_qwenimage21(num_layers: int = 2) -> QwenImage21Transformer2DModel:
    """diffusers' own test configuration (`test_models_transformer_qwenimage21.py`)."""
    torch.manual_seed(0)
    return QwenImage21Transformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=num_layers, attention_head_dim=16,
        num_attention_heads=2, context_in_dim=8, mlp_ratio=2, axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip


def qwenimage21_inputs(
    batch: int = 2, h: int = 6, w: int = 8, condition: tuple[int, int] | None = None, padded: int = PADDED
) -> dict:
    """As `QwenImage21Pipeline` calls the model without its KV cache (`use_kv_cache=False`).

    The prompt's `TEXT` tokens, the second sample's last `padded` masked (a batch of prompts of two lengths; no mask
    where `padded` is 0, as the pipeline passes none then); with
    `condition`, a condition image's `(rows, columns)` of tokens spliced into the prompt after its third token (one
    vision slot per 2 x 2 tokens), as the image-conditioned template places it. The generated image's slots close
    the vision-language sequence.
    """
    generator = torch.Generator().manual_seed(0)
    slots = [False] * TEXT
    shapes = [(1, h, w)]
    condition_tokens = 0
    if condition is not None:
        condition_tokens = condition[0] * condition[1]
        slots[3:3] = [True] * (condition_tokens // SLOT)
        shapes.insert(0, (1, *condition))
    img_mask = torch.tensor(slots + [True] * (h * w // SLOT)).expand(batch, -1)
    inputs = {
        "hidden_states": torch.randn(batch, condition_tokens + h * w, 4, generator=generator),
        "encoder_hidden_states": torch.randn(batch, len(slots), 8, generator=generator),
        "timestep": torch.full((batch,), 0.6),  # the pipeline passes t / 1000
        "img_shapes": [shapes] * batch,
        "img_mask": img_mask,
    }
    if padded:  # the pipeline passes no mask where no prompt is padded
        text_mask = torch.ones(batch, len(slots), dtype=torch.bool)
        text_mask[1:, len(slots) - padded :] = False
        inputs["encoder_hidden_states_mask"] = text_mask
    return inputs


class TextOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without its video processor, which needs torchvision (text-to-image calls use neither)."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


#: The chat template the pipeline's system prompt goes through: the messages' text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
)


def tiny_qwenimage21_pipeline(folder: Path) -> QwenImage21Pipeline:
    """Qwen-Image 2.1's pipeline, random weights: a one-layer Qwen3-VL reading the prompt (byte tokens), the
    Qwen-Image 2.1 VAE at one level and `tiny_qwenimage21`. Its KV cache is on (the pipeline's default): the first
    step runs the whole sequence, the second the generated image's tokens against the cached prompt."""
    tokenizer = write_qwen_tokenizer(folder / "qwen3vl")
    vision_tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    start, image, end, video = tokenizer.convert_tokens_to_ids(vision_tokens)
    processor = TextOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    text = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer),
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=8,
                  deepstack_visual_indexes=[])  # fmt: skip
    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage21(
        base_dim=4, decoder_base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()  # fmt: skip
    pipe = QwenImage21Pipeline(FlowMatchEulerDiscreteScheduler(), vae, text_encoder, processor, tiny_qwenimage21())
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- ERNIE-Image


def tiny_ernie_image(num_layers: int = 2, in_channels: int = 16) -> ErnieImageTransformer2DModel:
    """diffusers' own test configuration (`test_models_transformer_ernie_image.py`) at two heads and two layers.

    The model zero-initialises its modulation and its output projection (training starts from the identity): they
    get random values here, or every output would be zero with or without ToMe."""
    torch.manual_seed(0)
    model = ErnieImageTransformer2DModel(
        hidden_size=32, num_attention_heads=2, num_layers=num_layers, ffn_hidden_size=32, in_channels=in_channels,
        out_channels=in_channels, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4),
    ).eval()  # fmt: skip
    with torch.no_grad():
        for linear in (model.adaLN_modulation[-1], model.final_linear):
            linear.weight.normal_(std=0.1)
            linear.bias.normal_(std=0.1)
    return model


def ernie_image_inputs(batch: int = 2, h: int = 6, w: int = 8, padded: int = PADDED) -> dict:
    """As `ErnieImagePipeline` calls the model: the packed latent `(B, 128, H, W)` (16 channels here), the
    scheduler's timestep, and the prompts' embeddings padded to the longest (`text_lens`: the second sample's prompt
    is `padded` tokens shorter, as a negative prompt is)."""
    generator = torch.Generator().manual_seed(0)
    lengths = [TEXT] + [TEXT - padded] * (batch - 1)
    return {
        "hidden_states": torch.randn(batch, 16, h, w, generator=generator),
        "timestep": torch.full((batch,), 600.0),
        "text_bth": torch.randn(batch, TEXT, 16, generator=generator),
        "text_lens": torch.tensor(lengths),
    }


def tiny_ernie_image_pipeline(folder: Path) -> ErnieImagePipeline:
    """ERNIE-Image's pipeline, random weights: Mistral 3 (one text layer; the pipeline reads its second-to-last
    hidden states) over byte tokens, the FLUX.2 VAE at two levels (with the pipeline's 2 x 2 packing, 4 px a token)
    and `tiny_ernie_image` over its 8 packed channels; no prompt enhancer. Classifier-free guidance runs in one
    batch, the negative prompt shorter than the prompt (padded and masked)."""
    tokenizer = write_qwen_tokenizer(folder / "mistral")
    last = len(tokenizer) - 1  # <|endoftext|>: begin, end and padding
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=37,
                num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_hidden_layers=1,
                max_position_embeddings=64, sliding_window=None, bos_token_id=last, eos_token_id=last,
                pad_token_id=last)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=37, image_size=30, patch_size=6)  # fmt: skip
    torch.manual_seed(0)
    text_encoder = Mistral3Model(Mistral3Config(text_config=text, vision_config=vision, image_token_index=last + 1))
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 4), layers_per_block=1, latent_channels=2,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()  # fmt: skip
    pipe = ErnieImagePipeline(tiny_ernie_image(in_channels=8), vae, text_encoder.eval(), tokenizer,
                              FlowMatchEulerDiscreteScheduler())  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


CASES = (
    FamilyCase(
        name="qwenimage21",
        family="qwenimage21",
        build=tiny_qwenimage21,
        inputs=qwenimage21_inputs,
        # Per block: the prompt's causal call (its keys unchanged) and the generated image's call over every key.
        merged_calls=2,
        pipeline=PipelineCase(
            build=tiny_qwenimage21_pipeline,
            call_kwargs=dict(
                prompt="a cat on a mat",
                negative_prompt="dark",
                true_cfg_scale=2.0,
                height=64,
                width=96,
                num_inference_steps=2,
                output_type="pt",
            ),  # fmt: skip
            height=64,
            width=96,
        ),
    ),
    FamilyCase(
        name="qwenimage21-condition",
        family="qwenimage21",
        build=tiny_qwenimage21,
        inputs=lambda **k: qwenimage21_inputs(condition=(2, 4), **k),
        # Per block: three prefix calls (prompt, condition image, prompt), never merged, and the generated image's.
        merged_calls=2,
    ),
    FamilyCase(
        name="ernie_image",
        family="ernie_image",
        build=tiny_ernie_image,
        inputs=ernie_image_inputs,
        merged_calls=2,  # one joint attention per block
        set_attn_processor=False,  # the model has no `set_attn_processor` (no `AttentionMixin`)
        pipeline=PipelineCase(
            build=tiny_ernie_image_pipeline,
            call_kwargs=dict(
                prompt="a cat on a mat",
                negative_prompt="dark",
                guidance_scale=3.0,
                height=32,
                width=48,
                num_inference_steps=2,
                output_type="pt",
                use_pe=False,
            ),  # fmt: skip
            height=32,
            width=48,
        ),
    ),
)
