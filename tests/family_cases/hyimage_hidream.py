"""HunyuanImage 2.1 and HiDream-I1: tiny random-weight models, their inputs as their pipelines pass them, and tiny
offline pipelines.

HunyuanImage: diffusers' pipeline-test transformer shape (narrower), with ByT5's glyph tokens; its mask masks the
prompt's padding. HiDream: diffusers' model-test shape, at a non-square grid (padded to `max_resolution`'s tokens,
with the padding mask) and a square one (no padding, no mask).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLHunyuanImage,
    FlowMatchEulerDiscreteScheduler,
    HiDreamImagePipeline,
    HiDreamImageTransformer2DModel,
    HunyuanImagePipeline,
    HunyuanImageTransformer2DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from transformers import (
    ByT5Tokenizer,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    T5Config,
    T5EncoderModel,
)

from tome_processors.bench.pipelines import write_clip_tokenizer, write_t5_tokenizer

from . import FamilyCase, PipelineCase

TEXT = 7  # prompt tokens: not a multiple of anything, so an off-by-text error shows
HY_TEXT_DIM, HY_GLYPH_DIM, HY_GLYPH = 16, 8, 5  # HunyuanImage's Qwen width, ByT5's width and its tokens
HD_T5_DIM, HD_LLAMA_DIM, HD_POOLED, HD_LLAMA = 8, 4, 8, 5  # HiDream's T5, Llama and pooled CLIP widths; Llama tokens
HD_LAYERS = 3  # the Llama layers the pipeline stacks (its text encoder's depth)
#: HiDream's Llama layers come as one tensor, layers first (`(layers, B, tokens, C)`): the table's split into
#: samples cuts the leading axis only, so its check is skipped and tests/test_hyimage_hidream.py splits the batch.
HD_NOT_INDEPENDENT = "the Llama stack's batch is its second axis: tests/test_hyimage_hidream.py checks each sample"


# ---------------------------------------------------------------- HunyuanImage 2.1


def tiny_hunyuanimage(in_channels: int = 4, text_dim: int = HY_TEXT_DIM) -> HunyuanImageTransformer2DModel:
    """One double- and two single-stream blocks, 2 heads of 16 (rotary axes 8 + 8), patch (1, 1), ByT5 glyph text."""
    torch.manual_seed(0)
    return HunyuanImageTransformer2DModel(
        in_channels=in_channels, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=text_dim,
        text_embed_2_dim=HY_GLYPH_DIM, rope_axes_dim=(8, 8),
    ).eval()  # fmt: skip


def hunyuanimage_inputs(batch: int = 2, h: int = 6, w: int = 8) -> dict:
    """As `HunyuanImagePipeline` calls the model (one guidance branch): the latent, the timestep on 0..1000, the
    Qwen prompt with its last two tokens padding, ByT5's glyph text with one padded token in the second sample."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[:, -2:] = 0
    glyph_mask = torch.ones(batch, HY_GLYPH, dtype=torch.long)
    glyph_mask[-1, -1] = 0
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "timestep": torch.full((batch,), 600.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, HY_TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": torch.randn(batch, HY_GLYPH, HY_GLYPH_DIM, generator=g),
        "encoder_attention_mask_2": glyph_mask,
    }


def tiny_hunyuanimage_refiner() -> HunyuanImageTransformer2DModel:
    """The refiner's shape: patch (1, 1, 1) over a 5-D latent of one frame (the noisy latent and the image's over
    channels), 3-axis rotary, guidance and MeanFlow's second timestep embedded, no glyph text."""
    torch.manual_seed(0)
    return HunyuanImageTransformer2DModel(
        in_channels=8, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1, 1), text_embed_dim=HY_TEXT_DIM,
        rope_axes_dim=(4, 6, 6), guidance_embeds=True, use_meanflow=True,
    ).eval()  # fmt: skip


def hunyuanimage_refiner_inputs(batch: int = 2, h: int = 6, w: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[:, -3:] = 0
    return {
        "hidden_states": torch.randn(batch, 8, 1, h, w, generator=g),
        "timestep": torch.full((batch,), 600.0),
        "timestep_r": torch.full((batch,), 400.0),
        "guidance": torch.full((batch,), 3500.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, HY_TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
    }


def tiny_hunyuanimage_pipeline(folder: Path) -> HunyuanImagePipeline:
    """HunyuanImage 2.1's pipeline, random weights: Qwen2.5-VL's text model over a byte-level tokenizer (a short
    template, cropped as the pipeline crops its own; 16 tokens instead of 1,000), ByT5 (its tokenizer needs no
    files; 8 tokens instead of 128), diffusers' test-size VAE (8x: only its factor is read, the call stops at the
    latents) and classifier-free guidance (two model calls a step, batch 1)."""
    from test_new_families import write_qwen_tokenizer

    tokenizer = write_qwen_tokenizer(folder / "qwen")
    last = len(tokenizer) - 1
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(vocab_size=len(tokenizer), hidden_size=HY_TEXT_DIM, intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                             rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default"},
                             bos_token_id=last, eos_token_id=last)
    ).eval()  # fmt: skip
    tokenizer_2 = ByT5Tokenizer()
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_2), d_model=HY_GLYPH_DIM, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
        spatial_compression_ratio=8, sample_size=64,
    ).eval()  # fmt: skip
    pipe = HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=tiny_hunyuanimage(),
        guider=ClassifierFreeGuidance(guidance_scale=3.5),
    )
    pipe.set_progress_bar_config(disable=True)
    # After the crop, the prompt and the template's end (as the real template's `<|im_end|>`): an empty negative
    # prompt keeps one valid token, whose mean the token refiner takes.
    pipe.prompt_template_encode = "Describe: {}\n"
    pipe.prompt_template_encode_start_idx = len(tokenizer("Describe: ").input_ids)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 16, 8
    return pipe


# ---------------------------------------------------------------- HiDream-I1


def tiny_hidream(max_resolution: tuple[int, int] = (16, 16)) -> HiDreamImageTransformer2DModel:
    """One double- and two single-stream blocks, 2 heads of 8, a mixture of 2 experts; `max_resolution` 16 x 16
    latent pixels: a non-square grid is padded to 64 tokens."""
    torch.manual_seed(0)
    return HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, caption_channels=[HD_T5_DIM, HD_LLAMA_DIM], text_emb_dim=HD_POOLED,
        num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=max_resolution,
        llama_layers=(0, 1, 2),
    ).eval()  # fmt: skip


def hidream_inputs(batch: int = 2, h: int = 6, w: int = 8) -> dict:
    """As `HiDreamImagePipeline` calls the model: the latent (`2h x 2w` latent pixels: `h x w` tokens), `timesteps`
    on 0..1000, T5's prompt, the Llama layers' stack `(layers, B, tokens, C)` and the pooled CLIP embeddings."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
        "timesteps": torch.full((batch,), 600.0),
        "encoder_hidden_states_t5": torch.randn(batch, TEXT, HD_T5_DIM, generator=g),
        "encoder_hidden_states_llama3": torch.randn(HD_LAYERS, batch, HD_LLAMA, HD_LLAMA_DIM, generator=g),
        "pooled_embeds": torch.randn(batch, HD_POOLED, generator=g),
    }


def tiny_hidream_pipeline(folder: Path) -> HiDreamImagePipeline:
    """HiDream-I1's pipeline, random weights: two CLIP text encoders with projections (their pooled outputs), T5 and
    Llama over tokenizers written to `folder`, a two-level VAE (2x: the call stops at the latents) and `tiny_hidream`.
    The pipeline resizes every request to the area of `default_sample_size` latent pixels squared (128: 1024 x 1024
    px on the real VAE); here 16 (32 x 32 px), so a 24 x 36 px request stays as it is: 6 x 9 tokens, padded to 64."""
    from test_new_families import tiny_flow_vae, write_qwen_tokenizer

    tokenizer = write_clip_tokenizer(folder / "clip", max_length=32)  # both CLIPs': start 0, end and padding 1
    clip = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=32, projection_dim=HD_POOLED // 2,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    text_encoder = CLIPTextModelWithProjection(clip).eval()
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(clip).eval()
    tokenizer_3 = write_t5_tokenizer(folder / "t5")
    torch.manual_seed(0)
    text_encoder_3 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_3), d_model=HD_T5_DIM, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    ).eval()
    tokenizer_4 = write_qwen_tokenizer(folder / "llama")
    tokenizer_4.eos_token = "<|endoftext|>"
    last = len(tokenizer_4) - 1
    torch.manual_seed(0)
    text_encoder_4 = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(tokenizer_4), hidden_size=HD_LLAMA_DIM, intermediate_size=8,
                    num_hidden_layers=HD_LAYERS,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=last,
                    eos_token_id=last, pad_token_id=last, attn_implementation="eager")
    ).eval()  # fmt: skip
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_flow_vae(4),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
        text_encoder_4=text_encoder_4,
        tokenizer_4=tokenizer_4,
        transformer=tiny_hidream(),
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.default_sample_size = 16
    return pipe


CASES = (
    FamilyCase(
        name="hunyuanimage",
        family="hunyuanimage",
        build=tiny_hunyuanimage,
        inputs=hunyuanimage_inputs,
        merged_calls=3,  # the double-stream block and both single-stream blocks; never the token refiner
        pipeline=PipelineCase(
            build=tiny_hunyuanimage_pipeline,
            call_kwargs={
                "prompt": 'a "hi" sign',
                "height": 48,
                "width": 64,
                "num_inference_steps": 2,
                "output_type": "latent",
            },
            height=48,
            width=64,
        ),
    ),
    FamilyCase(
        name="hunyuanimage-refiner",
        family="hunyuanimage",
        build=tiny_hunyuanimage_refiner,
        inputs=hunyuanimage_refiner_inputs,
        merged_calls=2,
    ),
    FamilyCase(
        name="hidream",
        family="hidream",
        build=tiny_hidream,
        inputs=hidream_inputs,  # 6 x 8 tokens: padded to 64, with the padding mask
        merged_calls=3,  # the double-stream block and both single-stream blocks
        set_attn_processor=False,  # the model has no `set_attn_processor`: apply_tome and enable_tome only
        batch_independent=False,
        why_not_independent=HD_NOT_INDEPENDENT,
        pipeline=PipelineCase(
            build=tiny_hidream_pipeline,
            call_kwargs={
                "prompt": "a cat on a mat",
                "height": 24,
                "width": 36,
                "num_inference_steps": 2,
                "guidance_scale": 5.0,
                "max_sequence_length": 8,
                "output_type": "latent",
            },
            height=24,
            width=36,
        ),
    ),
    FamilyCase(
        name="hidream-square",
        family="hidream",
        build=tiny_hidream,
        inputs=lambda batch=2: hidream_inputs(batch, 6, 6),  # no padding, no mask
        merged_calls=3,
        set_attn_processor=False,
        batch_independent=False,
        why_not_independent=HD_NOT_INDEPENDENT,
    ),
)
