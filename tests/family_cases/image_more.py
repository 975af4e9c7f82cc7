"""Bria, Bria Fibo and Fibo 2, GLM-Image, Ideogram 4, Nucleus-MoE-Image, PRX and Ovis-Image (`families/image_more.py`).

Tiny random-weight models: diffusers' own test configurations where they have one (Bria Fibo 2, Ideogram 4,
Nucleus-MoE-Image), else small dims of each class's structure, one or two blocks per list. Inputs as the pipelines
build them: batch 2, a 6 x 8 token grid and 7 text tokens (the second prompt's last two padding where the pipeline
masks padding).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    BriaFibo2Pipeline,
    BriaFibo2Transformer2DModel,
    BriaFiboPipeline,
    BriaFiboTransformer2DModel,
    BriaPipeline,
    BriaTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
    GlmImagePipeline,
    GlmImageTransformer2DModel,
    Ideogram4Pipeline,
    Ideogram4Transformer2DModel,
    NucleusMoEImagePipeline,
    NucleusMoEImageTransformer2DModel,
    OvisImagePipeline,
    OvisImageTransformer2DModel,
    PRXPipeline,
    PRXTransformer2DModel,
)
from diffusers.models.transformers.transformer_ideogram4 import (
    IMAGE_POSITION_OFFSET,
    LLM_TOKEN_INDICATOR,
    OUTPUT_IMAGE_INDICATOR,
    SEQUENCE_PADDING_INDICATOR,
)
from transformers import (
    ByT5Tokenizer,
    Qwen3Config,
    Qwen3Model,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLModel,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    T5Config,
    T5EncoderModel,
    T5GemmaConfig,
)
from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

from tome_processors.bench.pipelines import write_t5_tokenizer

from family_cases import FamilyCase, PipelineCase
from family_cases.qwen_ernie import TextOnlyQwen3VLProcessor
from test_new_families import Qwen2VLImageProcessor, tiny_flow_vae, write_qwen_tokenizer

TEXT, H, W = 7, 6, 8
PADDED = 2  # the second prompt's padding, where the pipeline masks it


def grid_ids(h: int = H, w: int = W, columns: int = 3) -> torch.Tensor:
    """FLUX.1's pipelines' `img_ids`: `(0, row, column)` for each token of a row-major `h x w` grid."""
    out = torch.zeros(h, w, columns)
    out[..., 1] = torch.arange(h)[:, None]
    out[..., 2] = torch.arange(w)[None]
    return out.view(h * w, columns)


def text_valid(batch: int, text: int = TEXT) -> torch.Tensor:
    """`(batch, text)` booleans: every prompt's tokens valid but the second's last `PADDED`."""
    valid = torch.ones(batch, text, dtype=torch.bool)
    valid[1:, -PADDED:] = False
    return valid


# ---------------------------------------------------------------- Bria, Ovis-Image (FLUX.1's blocks)


def tiny_bria(in_channels: int = 16, text_dim: int = 16) -> BriaTransformer2DModel:
    """One double- and two single-stream blocks of 2 heads of 16."""
    torch.manual_seed(0)
    return BriaTransformer2DModel(
        patch_size=1, in_channels=in_channels, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_dim, axes_dims_rope=[4, 6, 6],
    ).eval()  # fmt: skip


def bria_inputs(batch: int = 2) -> dict:
    """As `BriaPipeline` calls the model: zero text ids, FLUX.1's image ids, the scheduler's 0..1000 timestep."""
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, H * W, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "timestep": torch.full((batch,), 600.0),
        "img_ids": grid_ids(),
        "txt_ids": torch.zeros(TEXT, 3),
    }


def tiny_ovis(in_channels: int = 16, text_dim: int = 16) -> OvisImageTransformer2DModel:
    """One double- and two single-stream blocks of 2 heads of 16."""
    torch.manual_seed(0)
    return OvisImageTransformer2DModel(
        patch_size=1, in_channels=in_channels, out_channels=in_channels, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_dim, axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip


def ovis_inputs(batch: int = 2) -> dict:
    """As `OvisImagePipeline` calls the model: `t / 1000`, zero text ids, FLUX.1's image ids."""
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, H * W, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "img_ids": grid_ids(),
        "txt_ids": torch.zeros(TEXT, 3),
    }


# ---------------------------------------------------------------- Bria Fibo


def tiny_bria_fibo(in_channels: int = 16, text_dim: int = 16) -> BriaFiboTransformer2DModel:
    """One double- and two single-stream blocks of 2 heads of 16; text layers of `text_dim`."""
    torch.manual_seed(0)
    return BriaFiboTransformer2DModel(
        patch_size=1, in_channels=in_channels, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=2 * text_dim, axes_dims_rope=[4, 6, 6], text_encoder_dim=text_dim,
    ).eval()  # fmt: skip


def bria_fibo_inputs(batch: int = 2) -> dict:
    """As `BriaFiboPipeline` calls the model: the last two text layers as `encoder_hidden_states`, one text layer per
    block, zero text ids, one token per latent pixel, and the key-padding mask over `[text; image]` (boolean
    `(B, 1, 1, S)`, given since the second prompt is padded)."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.cat([text_valid(batch), torch.ones(batch, H * W, dtype=torch.bool)], dim=1)
    return {
        "hidden_states": torch.randn(batch, H * W, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 32, generator=generator),
        "text_encoder_layers": [torch.randn(batch, TEXT, 16, generator=generator) for _ in range(3)],
        "timestep": torch.full((batch,), 600.0),
        "img_ids": grid_ids(),
        "txt_ids": torch.zeros(TEXT, 3),
        "joint_attention_kwargs": {"attention_mask": mask[:, None, None, :]},
    }


# ---------------------------------------------------------------- Bria Fibo 2


def tiny_bria_fibo2() -> BriaFibo2Transformer2DModel:
    """diffusers' test configuration: a refiner block and two main blocks (the second an injection block)."""
    torch.manual_seed(0)
    return BriaFibo2Transformer2DModel(
        in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, cap_feat_dim=24,
        injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=4,
        gist_min_text_len=4, gist_max_text_len=16, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16),
    ).eval()  # fmt: skip


def bria_fibo2_inputs(batch: int = 2, context: tuple[int, int] | None = None, mask: bool = False) -> dict:
    """As `BriaFibo2Pipeline` calls the model: the 4-D latent, the noise level in 0..1, the text bundles (the
    Perceiver's, then the injection block's); with `context`, an image to edit of that latent size; with `mask`, the
    prompts' padding mask (the second prompt's last two tokens)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(batch, 4, 2 * H, 2 * W, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "encoder_hidden_states": torch.randn(batch, 2, TEXT, 24, generator=generator),
    }
    if mask:
        inputs["encoder_attention_mask"] = text_valid(batch)
    if context is not None:
        inputs["context_latents"] = [torch.randn(batch, 4, *context, generator=generator)]
    return inputs


# ---------------------------------------------------------------- GLM-Image


def tiny_glm_image() -> GlmImageTransformer2DModel:
    """Two blocks of 2 heads of 8; a prior codebook of 32 tokens."""
    torch.manual_seed(0)
    return GlmImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        text_embed_dim=16, time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=32,
    ).eval()  # fmt: skip


def glm_image_inputs(batch: int = 2) -> dict:
    """As `GlmImagePipeline` calls the model (one guidance branch): the 4-D latent, the glyph text, a prior token per
    patch, the scheduler's timestep less one, the image size to make; and a mask over the text (the second prompt
    padded)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, 4, 2 * H, 2 * W, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "prior_token_id": torch.randint(0, 32, (batch, H * W), generator=generator),
        "prior_token_drop": torch.zeros(batch, H * W, dtype=torch.bool),
        "timestep": torch.full((batch,), 599.0),
        "target_size": torch.tensor([[16.0 * H, 16.0 * W]]).expand(batch, 2),
        "crop_coords": torch.zeros(batch, 2),
        "attention_mask": text_valid(batch).long(),
    }


# ---------------------------------------------------------------- Ideogram 4


def tiny_ideogram4(llm_features_dim: int = 24) -> Ideogram4Transformer2DModel:
    """diffusers' test configuration: two blocks of 4 heads of 8."""
    torch.manual_seed(0)
    return Ideogram4Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, intermediate_size=32, adaln_dim=16,
        llm_features_dim=llm_features_dim, rope_theta=10_000, mrope_section=(2, 1, 1), norm_eps=1e-5,
    ).eval()  # fmt: skip


def ideogram4_inputs(batch: int = 2, text: int = TEXT) -> dict:
    """As `Ideogram4Pipeline` calls its conditional model: `[left padding; text; image]` packed, the second prompt two
    tokens shorter (left-padded), ids, segments and roles as `_prepare_ids` builds them, the model's time `0.4` (0 is
    noise); with `text=0`, as it calls the unconditional model (the image alone)."""
    generator = torch.Generator().manual_seed(0)
    seq = text + H * W
    position_ids = torch.zeros(batch, seq, 3, dtype=torch.long)
    segment_ids = torch.full((batch, seq), SEQUENCE_PADDING_INDICATOR, dtype=torch.long)
    indicator = torch.zeros(batch, seq, dtype=torch.long)
    image = torch.stack([torch.zeros(H * W, dtype=torch.long), *grid_ids()[:, 1:].long().unbind(-1)], -1)
    for b in range(batch):
        real = text - (PADDED if b == 1 and text else 0)
        start = text - real
        position_ids[b, start:text] = torch.arange(real)[:, None]
        position_ids[b, text:] = image + IMAGE_POSITION_OFFSET
        indicator[b, start:text], indicator[b, text:] = LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR
        segment_ids[b, start:] = 1
    hidden = torch.zeros(batch, seq, 16)
    hidden[:, text:] = torch.randn(batch, H * W, 16, generator=generator)
    features = torch.zeros(batch, seq, 24)
    features[:, :text] = torch.randn(batch, text, 24, generator=generator) * (indicator[:, :text, None] > 0)
    return {
        "hidden_states": hidden,
        "timestep": torch.full((batch,), 0.4),
        "encoder_hidden_states": features,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "indicator": indicator,
    }


# ---------------------------------------------------------------- Nucleus-MoE-Image


def tiny_nucleusmoe() -> NucleusMoEImageTransformer2DModel:
    """diffusers' test configuration (dense blocks), with 2 key/value heads for the 4 query heads."""
    torch.manual_seed(0)
    return NucleusMoEImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4), moe_enabled=False,
        capacity_factors=[8.0, 8.0],
    ).eval()  # fmt: skip


def nucleusmoe_inputs(batch: int = 2) -> dict:
    """As `NucleusMoEImagePipeline` calls the model (one guidance branch): packed tokens, `img_shapes` per sample, the
    prompt's padding mask, `t / 1000`."""
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, H * W, 16, generator=generator),
        "img_shapes": [(1, H, W)] * batch,
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "encoder_hidden_states_mask": text_valid(batch).long(),
        "timestep": torch.full((batch,), 0.6),
    }


# ---------------------------------------------------------------- PRX


def tiny_prx(in_channels: int = 4, text_dim: int = 16) -> PRXTransformer2DModel:
    """Two blocks of 2 heads of 16 over 2 x 2 patches, random modulation."""
    torch.manual_seed(0)
    model = PRXTransformer2DModel(
        in_channels=in_channels, patch_size=2, context_in_dim=text_dim, hidden_size=32, mlp_ratio=2.0, num_heads=2,
        depth=2, axes_dim=[8, 8],
    ).eval()  # fmt: skip
    for block in model.blocks:  # the class starts its modulation at zero (every gate shut): a trained model's are not
        torch.nn.init.normal_(block.modulation.lin.weight, std=0.2)
        torch.nn.init.normal_(block.modulation.lin.bias, std=0.2)
    return model


def prx_inputs(batch: int = 2) -> dict:
    """As `PRXPipeline` calls the model: the 4-D latent, `t / 1000`, the text and its padding mask `(B, T)`."""
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, 4, 2 * H, 2 * W, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "attention_mask": text_valid(batch),
    }


# ---------------------------------------------------------------- pipelines (tiny, offline)

#: One call of each pipeline: 2 steps at 32 x 32 px (64 x 64 where the VAE is 16x), guidance on.
CALL = dict(prompt="a cat", negative_prompt="dark", num_inference_steps=2, height=32, width=32, output_type="pt")


def tiny_t5(folder: Path) -> tuple[T5EncoderModel, object]:
    """A one-layer T5 encoder of width 16 over single characters."""
    tokenizer = write_t5_tokenizer(folder)
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return T5EncoderModel(config).eval(), tokenizer


def tiny_bria_pipeline(folder: Path) -> BriaPipeline:
    """BRIA 3.x's pipeline, random weights: a one-layer T5, a two-level 4-channel VAE (the pipeline counts it 4 px a
    latent pixel: 32 px are 8 x 8 tokens) and `tiny_bria`. Guidance runs as one batch of both halves."""
    text_encoder, tokenizer = tiny_t5(folder / "t5")
    pipe = BriaPipeline(tiny_bria(), FlowMatchEulerDiscreteScheduler(), tiny_flow_vae(4), text_encoder, tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_ovis_pipeline(folder: Path) -> OvisImagePipeline:
    """Ovis-Image's pipeline, random weights: a one-layer Qwen3 over byte tokens, a two-level 4-channel VAE (32 px are
    8 x 8 tokens) and `tiny_ovis`. Guidance runs as a second call."""
    tokenizer = write_qwen_tokenizer(folder / "qwen")
    torch.manual_seed(0)
    text_encoder = Qwen3Model(
        Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    ).eval()  # fmt: skip
    pipe = OvisImagePipeline(FlowMatchEulerDiscreteScheduler(), tiny_flow_vae(4), text_encoder, tokenizer, tiny_ovis())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_prx_pipeline(folder: Path) -> PRXPipeline:
    """PRX's pipeline, random weights: a one-layer T5Gemma encoder over single characters, a two-level 4-channel VAE
    (2 px a latent pixel: 32 px are 8 x 8 tokens of 2 x 2 latent pixels) and `tiny_prx`. Guidance runs as one batch
    of both halves, the prompts padded to the tokenizer's length and masked."""
    tokenizer = write_t5_tokenizer(folder / "t5")
    tokenizer.model_max_length = 16
    torch.manual_seed(0)
    encoder = dict(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, pad_token_id=0,
    )  # fmt: skip
    text_encoder = T5GemmaEncoder(T5GemmaConfig(encoder=encoder, decoder=encoder).encoder).eval()
    pipe = PRXPipeline(tiny_prx(), FlowMatchEulerDiscreteScheduler(), text_encoder, tokenizer, tiny_flow_vae(4))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_bria_fibo_pipeline(folder: Path) -> BriaFiboPipeline:
    """Bria FIBO's pipeline, random weights: a two-layer SmolLM3 over byte tokens (its last two layers the prompt's
    embeddings, its layers the blocks' text), a one-level 16-channel Wan VAE (the pipeline counts 16 px a latent pixel:
    64 px are 4 x 4 tokens) and `tiny_bria_fibo`. Guidance runs as one batch of both halves: the shorter prompt's
    padding is masked."""
    tokenizer = write_qwen_tokenizer(folder / "qwen")
    torch.manual_seed(0)
    config = SmolLM3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    text_encoder = SmolLM3ForCausalLM(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
        latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
    ).eval()  # fmt: skip
    pipe = BriaFiboPipeline(tiny_bria_fibo(), FlowMatchEulerDiscreteScheduler(), vae, text_encoder, tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_glm_image_pipeline(folder: Path) -> GlmImagePipeline:
    """GLM-Image's pipeline, random weights: ByT5's byte tokenizer (no files) and a one-layer T5 as the glyph encoder
    (it reads the prompt's quoted text), a two-level 4-channel VAE (2 px a latent pixel: 32 px are 8 x 8 tokens of 2 x
    2 latent pixels) and `tiny_glm_image`. The prior tokens, which GLM-Image's autoregressive model would generate, are
    given (`prior_token_ids`, one per token): no vision-language model or processor. Guidance runs as a second call."""
    tokenizer = ByT5Tokenizer()
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    text_encoder = T5EncoderModel(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4, norm_num_groups=8,
        sample_size=32, latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()  # fmt: skip
    pipe = GlmImagePipeline(
        tokenizer, None, text_encoder, None, vae, tiny_glm_image(), FlowMatchEulerDiscreteScheduler()
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: The chat template Nucleus-MoE-Image's prompt goes through: the system prompt, then the user's text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{% endfor %}"
)


def tiny_nucleusmoe_pipeline(folder: Path) -> NucleusMoEImagePipeline:
    """Nucleus-MoE-Image's pipeline, random weights: a two-layer Qwen3-VL over byte tokens (its last layer tapped:
    `return_index=-1`), the Qwen-Image VAE at two levels (4 px a latent pixel: 32 px are 4 x 4 tokens of 2 x 2 latent
    pixels) and `tiny_nucleusmoe`. Guidance runs as a second call, each with its prompt's mask where it is padded."""
    text_encoder, processor = tiny_qwen3vl(folder / "qwen3vl", hidden=16, layers=2)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()  # fmt: skip
    pipe = NucleusMoEImagePipeline(tiny_nucleusmoe(), FlowMatchEulerDiscreteScheduler(), vae, text_encoder, processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_qwen3vl(folder: Path, hidden: int, layers: int) -> tuple[Qwen3VLForConditionalGeneration, object]:
    """A Qwen3-VL of `layers` layers of width `hidden` over byte tokens, and its text-only processor."""
    tokenizer = write_qwen_tokenizer(folder)
    vision_tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    start, image, end, video = tokenizer.convert_tokens_to_ids(vision_tokens)
    processor = TextOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56), tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    text = dict(hidden_size=hidden, intermediate_size=16, num_hidden_layers=layers, num_attention_heads=2,
                num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer),
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden,
                  deepstack_visual_indexes=[])  # fmt: skip
    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    return Qwen3VLForConditionalGeneration(config).eval(), processor


def tiny_bria_fibo2_pipeline(folder: Path) -> BriaFibo2Pipeline:
    """Bria Fibo 2.0's pipeline, random weights: a two-layer Qwen3-VL of width 8 over byte tokens (two bundles of three
    of its layers: the Perceiver's and the injection block's 24-wide text), FLUX.2's VAE at two levels (2 px a latent
    pixel: 32 px are 8 x 8 tokens of 2 x 2 latent pixels) and `tiny_bria_fibo2`. Guidance runs as a second call."""
    text_encoder, processor = tiny_qwen3vl(folder / "qwen3vl", hidden=8, layers=2)
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 4), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()  # fmt: skip
    pipe = BriaFibo2Pipeline(tiny_bria_fibo2(), FlowMatchEulerDiscreteScheduler(), vae, text_encoder, processor)
    pipe.text_encoder_out_layers = ((0, 1, 2), (2, 1, 0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_ideogram4_pipeline(folder: Path) -> Ideogram4Pipeline:
    """Ideogram 4's pipeline, random weights: a Qwen3-VL text model of 36 layers of width 8 over byte tokens (the
    pipeline taps 13 of them: 104-wide text features), FLUX.2's VAE at two levels (2 px a latent pixel: 32 px are 8 x 8
    tokens of 2 x 2 latent pixels), and `tiny_ideogram4` twice: the conditional model (over 16 text slots and the image)
    and the unconditional one (the image alone), which `apply_tome(pipe)` leaves as it is (it is no `transformer`)."""
    tokenizer = write_qwen_tokenizer(folder / "qwen3vl")
    tokenizer.chat_template = CHAT_TEMPLATE
    text = dict(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=36,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=len(tokenizer),
        rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]},
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=8,
                  deepstack_visual_indexes=[])  # fmt: skip
    torch.manual_seed(0)
    text_encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision)).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 4), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()  # fmt: skip
    pipe = Ideogram4Pipeline(
        FlowMatchEulerDiscreteScheduler(), vae, text_encoder, tokenizer, tiny_ideogram4(104), tiny_ideogram4(104)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: Ideogram 4's call: a constant guidance scale (its default schedule is the 48 steps'), no negative prompt.
IDEOGRAM4_CALL = dict(CALL, guidance_scale=2.0, guidance_schedule=None, max_sequence_length=16)
del IDEOGRAM4_CALL["negative_prompt"]

#: GLM-Image's call: a prompt with quoted text for its glyph encoder, and the prior tokens (8 x 8, the codebook's).
GLM_CALL = dict(
    CALL, prompt='a sign saying "hi"', prior_token_ids=torch.arange(64).remainder(32)[None], guidance_scale=2.0
)
del GLM_CALL["negative_prompt"]  # (the pipeline's negative prompt is always empty)

#: Why two cases leave the table's batch check to tests/test_image_more.py.
SPLIT = "the table's split per sample does not reach into a list of batched tensors (checked in test_image_more.py)"

CASES = (
    # One double- and two single-stream blocks each.
    FamilyCase("bria", "bria", tiny_bria, bria_inputs, merged_calls=3, set_attn_processor=False,
               pipeline=PipelineCase(tiny_bria_pipeline, dict(CALL, max_sequence_length=16), 32, 32)),
    FamilyCase("ovis_image", "ovis_image", tiny_ovis, ovis_inputs, merged_calls=3, set_attn_processor=False,
               pipeline=PipelineCase(tiny_ovis_pipeline, dict(CALL, max_sequence_length=16), 32, 32)),
    FamilyCase("bria_fibo", "bria_fibo", tiny_bria_fibo, bria_fibo_inputs, merged_calls=3, set_attn_processor=False,
               batch_independent=False, why_not_independent=SPLIT,
               pipeline=PipelineCase(tiny_bria_fibo_pipeline, dict(CALL, height=64, width=64), 64, 64)),
    # The refiner block and the two main blocks (the injection block's cross-attention is not merged).
    FamilyCase("bria_fibo2", "bria_fibo2", tiny_bria_fibo2, bria_fibo2_inputs, merged_calls=3,
               pipeline=PipelineCase(tiny_bria_fibo2_pipeline, dict(CALL, guidance_scale=2.0), 32, 32)),
    # The same, a 4 x 4 context image's tokens after the image's, passed through.
    FamilyCase("bria_fibo2_context", "bria_fibo2", tiny_bria_fibo2,
               lambda batch=2: bria_fibo2_inputs(batch, context=(8, 8)), merged_calls=3, batch_independent=False,
               why_not_independent=SPLIT),
    FamilyCase("glm_image", "glm_image", tiny_glm_image, glm_image_inputs, merged_calls=2, set_attn_processor=False,
               pipeline=PipelineCase(tiny_glm_image_pipeline, GLM_CALL, 32, 32)),
    FamilyCase("ideogram4", "ideogram4", tiny_ideogram4, ideogram4_inputs, merged_calls=2,
               pipeline=PipelineCase(tiny_ideogram4_pipeline, IDEOGRAM4_CALL, 32, 32)),
    # The unconditional model's call: the image alone.
    FamilyCase("ideogram4_unconditional", "ideogram4", tiny_ideogram4, lambda batch=2: ideogram4_inputs(batch, 0),
               merged_calls=2),
    FamilyCase("nucleusmoe_image", "nucleusmoe_image", tiny_nucleusmoe, nucleusmoe_inputs, merged_calls=2,
               pipeline=PipelineCase(tiny_nucleusmoe_pipeline, dict(CALL, return_index=-1), 32, 32)),
    FamilyCase("prx", "prx", tiny_prx, prx_inputs, merged_calls=2,
               pipeline=PipelineCase(tiny_prx_pipeline, dict(CALL, use_resolution_binning=False), 32, 32)),
)  # fmt: skip
