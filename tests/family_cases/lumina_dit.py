"""Lumina 2, Lumina-Next, AuraFlow, DiT, Hunyuan-DiT and FramePack: tiny random-weight models (diffusers' own model-test
configs, a few dims changed where noted), their inputs as their pipelines pass them, and tiny offline pipelines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers import (
    AuraFlowPipeline,
    AuraFlowTransformer2DModel,
    AutoencoderKL,
    AutoencoderKLHunyuanVideo,
    DDIMScheduler,
    DDPMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
    HunyuanDiT2DModel,
    HunyuanDiTPipeline,
    HunyuanVideoFramepackPipeline,
    HunyuanVideoFramepackTransformer3DModel,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
    LuminaNextDiT2DModel,
    LuminaPipeline,
)
from diffusers.models.embeddings import get_2d_rotary_pos_embed, get_2d_rotary_pos_embed_lumina
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    Gemma2Config,
    Gemma2Model,
    GemmaConfig,
    GemmaModel,
    LlamaConfig,
    LlamaModel,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from tome_processors.bench.pipelines import write_clip_tokenizer, write_t5_tokenizer

from . import FamilyCase, PipelineCase

TEXT = 7  # prompt tokens: not a multiple of anything, so an off-by-text error shows
LUMINA_CAPTION = 32  # the caption width of diffusers' Lumina tests (Gemma's hidden size in the pipelines)


# ---------------------------------------------------------------- Lumina 2


def tiny_lumina2() -> Lumina2Transformer2DModel:
    """diffusers' model-test config: 3 heads of 8 (one key/value head), a refiner block each, 2 main layers."""
    torch.manual_seed(0)
    return Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=1,
        num_attention_heads=3, num_kv_heads=1, multiple_of=2, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128),
        cap_feat_dim=LUMINA_CAPTION,
    ).eval()  # fmt: skip


def lumina2_inputs(batch: int = 2, h: int = 6, w: int = 8, valid: tuple[int, ...] | None = None) -> dict:
    """As `Lumina2Pipeline` calls the model (one guidance branch): the latent, `t = 1 - sigma` (0.4: noise level
    600), Gemma's prompt padded to `TEXT` tokens and its mask, `valid` tokens of each sample (all, by default)."""
    g = torch.Generator().manual_seed(0)
    valid = valid or (TEXT,) * batch
    mask = torch.stack([torch.arange(TEXT) < n for n in valid]).long()
    return {
        "hidden_states": torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
        "timestep": torch.full((batch,), 0.4),
        "encoder_hidden_states": torch.randn(batch, TEXT, LUMINA_CAPTION, generator=g),
        "encoder_attention_mask": mask,
    }


# ---------------------------------------------------------------- Lumina-Next


def tiny_lumina_next() -> LuminaNextDiT2DModel:
    """diffusers' model-test config: 3 heads of 8 (one key/value head), 2 layers, the caption 32 wide; learned sigma
    (8 output channels), which the pipeline splits off."""
    torch.manual_seed(0)
    return LuminaNextDiT2DModel(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_attention_heads=3,
        num_kv_heads=1, multiple_of=16, learn_sigma=True, qk_norm=True, cross_attention_dim=LUMINA_CAPTION,
    ).eval()  # fmt: skip


def lumina_next_inputs(batch: int = 2, h: int = 6, w: int = 8) -> dict:
    """As `LuminaPipeline` calls the model: the latent, `t = 1 - sigma` (0.4), Gemma's prompt with the second sample's
    last two tokens padding, the pipeline's rotary table (`get_2d_rotary_pos_embed_lumina` over 384 x 384 patches, of
    which the model takes the grid's) and proportional attention's base length (a 256 x 256 px default image)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[-1, -2:] = 0
    return {
        "hidden_states": torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
        "timestep": torch.full((batch,), 0.4),
        "encoder_hidden_states": torch.randn(batch, TEXT, LUMINA_CAPTION, generator=g),
        "encoder_mask": mask,
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(8, 384, 384),
        "cross_attention_kwargs": {"base_sequence_length": 16**2},
    }


# ---------------------------------------------------------------- AuraFlow


def tiny_auraflow() -> AuraFlowTransformer2DModel:
    """diffusers' model-test config: 4 heads of 8, a joint and a single-stream block, positions for 16 x 16 tokens."""
    torch.manual_seed(0)
    return AuraFlowTransformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, out_channels=4,
        pos_embed_max_size=256,
    ).eval()  # fmt: skip


def auraflow_inputs(batch: int = 2, h: int = 6, w: int = 8) -> dict:
    """As `AuraFlowPipeline` calls the model: the latent, the prompt (its padding zeroed by the pipeline) and
    `t / 1000` (0.6)."""
    g = torch.Generator().manual_seed(0)
    text = torch.randn(batch, TEXT, 32, generator=g)
    text[-1, -2:] = 0.0
    return {
        "hidden_states": torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
        "encoder_hidden_states": text,
        "timestep": torch.full((batch,), 0.6),
    }


# ---------------------------------------------------------------- DiT


def tiny_dit(sample_size: int = 12, classes: int = 8) -> DiTTransformer2DModel:
    """diffusers' model-test config (2 heads of 4), 2 blocks; learned sigma (8 output channels) as DiT-XL-2's."""
    torch.manual_seed(0)
    return DiTTransformer2DModel(
        in_channels=4, out_channels=8, activation_fn="gelu-approximate", num_attention_heads=2, attention_head_dim=4,
        attention_bias=True, num_layers=2, norm_type="ada_norm_zero", num_embeds_ada_norm=classes, patch_size=2,
        sample_size=sample_size,
    ).eval()  # fmt: skip


def dit_inputs(batch: int = 2, side: int = 6) -> dict:
    """As `DiTPipeline` calls the model: a square latent (the model unpatchifies a square), the scheduler's timestep
    and the class labels (the last one the null class of classifier-free guidance)."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, 4, 2 * side, 2 * side, generator=g),
        "timestep": torch.full((batch,), 600, dtype=torch.long),
        "class_labels": torch.tensor([3, 8][:batch] if batch == 2 else [3] * batch),
    }


# ---------------------------------------------------------------- Hunyuan-DiT

HY_CLIP, HY_T5 = TEXT, 5  # the CLIP and mT5 prompt lengths (`text_len`, `text_len_t5`)


def tiny_hunyuandit(text_len: int = HY_CLIP, text_len_t5: int = HY_T5) -> HunyuanDiT2DModel:
    """diffusers' model-test config (2 heads of 8, 16 wide), 4 blocks: the last adds the first's output (a long
    skip)."""
    torch.manual_seed(0)
    return HunyuanDiT2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
        cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16, text_len=text_len,
        text_len_t5=text_len_t5, activation_fn="gelu-approximate",
    ).eval()  # fmt: skip


def hunyuandit_rotary(h: int, w: int, head_dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's `(cos, sin)` for `h x w` tokens, each `(h * w, head_dim)`: positions cropped from its base grid
    (512 px over 8 and the patch)."""
    crops = get_resize_crop_region_for_grid((h, w), 512 // 8 // 2)
    return get_2d_rotary_pos_embed(head_dim, crops, (h, w), output_type="pt")


def hunyuandit_inputs(batch: int = 2, h: int = 6, w: int = 8) -> dict:
    """As `HunyuanDiTPipeline` calls the model: the latent, the timestep (0..1000), CLIP's and mT5's prompts with
    their masks (padding in the second sample), the size conditions, the style and the rotary tables."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, HY_CLIP, dtype=torch.long)
    mask[-1, -2:] = 0
    mask_t5 = torch.ones(batch, HY_T5, dtype=torch.long)
    mask_t5[-1, -1:] = 0
    size = torch.tensor([[16.0 * h, 16.0 * w, 16.0 * h, 16.0 * w, 0.0, 0.0]]).repeat(batch, 1)
    return {
        "hidden_states": torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
        "timestep": torch.full((batch,), 600.0),
        "encoder_hidden_states": torch.randn(batch, HY_CLIP, 8, generator=g),
        "text_embedding_mask": mask,
        "encoder_hidden_states_t5": torch.randn(batch, HY_T5, 8, generator=g),
        "text_embedding_mask_t5": mask_t5,
        "image_meta_size": size,
        "style": torch.zeros(batch, dtype=torch.long),
        "image_rotary_emb": hunyuandit_rotary(h, w),
    }


# ---------------------------------------------------------------- FramePack

FP_TEXT_DIM, FP_POOLED, FP_IMAGE_DIM, FP_IMAGE_TOKENS = 16, 8, 16, 5
#: The history the pipeline keeps (`VANILLA` sampling): 16 latent frames at 4x, 2 at 2x, 1 at 1x (after the first
#: frame's).
FP_HISTORY = (16, 2, 1)


def tiny_framepack() -> HunyuanVideoFramepackTransformer3DModel:
    """diffusers' model-test config: 2 heads of 10 (rotary axes 2 + 4 + 4), a double- and a single-stream block, the
    history patch embedder and the image projection."""
    torch.manual_seed(0)
    return HunyuanVideoFramepackTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True, text_embed_dim=FP_TEXT_DIM,
        pooled_projection_dim=FP_POOLED, rope_axes_dim=(2, 4, 4), image_condition_type=None, has_image_proj=True,
        image_proj_dim=FP_IMAGE_DIM, has_clean_x_embedder=True,
    ).eval()  # fmt: skip


def framepack_inputs(batch: int = 2, frames: int = 2, h: int = 6, w: int = 8) -> dict:
    """As `HunyuanVideoFramepackPipeline` calls the model (`VANILLA` sampling): the clip's latent (`frames x 2h x 2w`),
    the timestep (0..1000), the prompt with the second sample's last two tokens padding, the pooled CLIP and the
    image encoder's tokens, the distilled guidance, and the history with the frame index of every latent frame."""
    g = torch.Generator().manual_seed(0)
    long, mid, short = FP_HISTORY
    indices = torch.arange(1 + long + mid + short + frames)
    prefix, long_at, mid_at, short_at, clip_at = indices.split([1, long, mid, short, frames])
    mask = torch.ones(batch, TEXT)
    mask[-1, -2:] = 0

    def latent(n: int) -> torch.Tensor:
        return torch.randn(batch, 4, n, 2 * h, 2 * w, generator=g)

    return {
        "hidden_states": latent(frames),
        "timestep": torch.full((batch,), 600.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, FP_TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, FP_POOLED, generator=g),
        "image_embeds": torch.randn(batch, FP_IMAGE_TOKENS, FP_IMAGE_DIM, generator=g),
        "indices_latents": clip_at,
        "guidance": torch.full((batch,), 6000.0),
        "latents_clean": latent(1 + short),
        "indices_latents_clean": torch.cat([prefix, short_at]),
        "latents_history_2x": latent(mid),
        "indices_latents_history_2x": mid_at,
        "latents_history_4x": latent(long),
        "indices_latents_history_4x": long_at,
    }


# ---------------------------------------------------------------- tiny offline pipelines


def tiny_vae8(latent_channels: int = 4) -> AutoencoderKL:
    """An 8x VAE (four levels, 8 channels wide): the released pipelines' factor, at which `explain_tome` counts."""
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=4, sample_size=32,
    ).eval()  # fmt: skip


def gemma_tokenizer(folder: Path):  # noqa: ANN201 (a Qwen2Tokenizer)
    """A byte-level tokenizer standing for Gemma's (whose files cannot be written offline): the Lumina pipelines only
    pad, truncate and mask with it."""
    from test_new_families import write_qwen_tokenizer

    return write_qwen_tokenizer(folder)


def tiny_lumina2_pipeline(folder: Path) -> Lumina2Pipeline:
    """Lumina-Image 2.0's pipeline, random weights: Gemma 2 (2 layers, 32 wide: the caption width) over a byte-level
    tokenizer, an 8x VAE (unused: the call stops at the latents), `tiny_lumina2`; one model call per guidance
    branch."""
    tokenizer = gemma_tokenizer(folder / "gemma")
    torch.manual_seed(0)
    text_encoder = Gemma2Model(
        Gemma2Config(vocab_size=len(tokenizer), hidden_size=LUMINA_CAPTION, intermediate_size=16, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                     pad_token_id=len(tokenizer) - 1)
    ).eval()  # fmt: skip
    pipe = Lumina2Pipeline(
        transformer=tiny_lumina2(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae8(4),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_lumina_next_pipeline(folder: Path) -> LuminaPipeline:
    """Lumina-Next's pipeline, random weights: Gemma (2 layers, 32 wide) over a byte-level tokenizer (prompts padded to
    16 tokens instead of 256), an 8x VAE (unused), `tiny_lumina_next`; both guidance halves in one batch, with
    proportional attention."""
    tokenizer = gemma_tokenizer(folder / "gemma")
    torch.manual_seed(0)
    text_encoder = GemmaModel(
        GemmaConfig(vocab_size=len(tokenizer), hidden_size=LUMINA_CAPTION, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                    pad_token_id=len(tokenizer) - 1)
    ).eval()  # fmt: skip
    pipe = LuminaPipeline(
        transformer=tiny_lumina_next(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae8(4),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )
    pipe.max_sequence_length = 16
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_auraflow_pipeline(folder: Path) -> AuraFlowPipeline:
    """AuraFlow's pipeline, random weights: UMT5 (one layer, 32 wide) over a T5 tokenizer, an 8x VAE (its factor is
    read; the call stops at the latents), `tiny_auraflow`."""
    tokenizer = write_t5_tokenizer(folder / "t5")
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=16, num_layers=1, num_heads=2)
    ).eval()
    pipe = AuraFlowPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=tiny_vae8(4),
        transformer=tiny_auraflow(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_dit_pipeline(folder: Path) -> DiTPipeline:
    """DiT's pipeline, random weights: `tiny_dit` over ImageNet's 1,000 classes (and the null class), 12 x 12 latent
    pixels (the pipeline generates at the model's `sample_size`), an 8x VAE that decodes them (96 x 96 px)."""
    pipe = DiTPipeline(transformer=tiny_dit(classes=1000), vae=tiny_vae8(4), scheduler=DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_bert_tokenizer(folder: Path, max_length: int = 77) -> BertTokenizer:
    """A WordPiece tokenizer over single characters (BERT's special tokens first), written to `folder` and loaded."""
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    symbols = list("abcdefghijklmnopqrstuvwxyz0123456789,.-'")
    vocab = specials + symbols + ["##" + symbol for symbol in symbols]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return BertTokenizer(str(folder / "vocab.txt"), model_max_length=max_length)


def tiny_hunyuandit_pipeline(folder: Path) -> HunyuanDiTPipeline:
    """Hunyuan-DiT's pipeline, random weights: a BERT (one layer, 8 wide) standing for its CLIP (77 tokens) over a
    WordPiece tokenizer, T5 standing for mT5 (256 tokens), an 8x VAE (the pipeline counts the grid at 8x; the call
    stops at the latents), `tiny_hunyuandit` at those text lengths, no safety checker."""
    tokenizer = write_bert_tokenizer(folder / "bert")
    torch.manual_seed(0)
    text_encoder = BertModel(
        BertConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=16, max_position_embeddings=80)
    ).eval()  # fmt: skip
    tokenizer_2 = write_t5_tokenizer(folder / "t5")
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_2), d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    ).eval()
    pipe = HunyuanDiTPipeline(
        vae=tiny_vae8(4),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_hunyuandit(text_len=77, text_len_t5=256),
        scheduler=DDPMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_framepack_pipeline(folder: Path) -> HunyuanVideoFramepackPipeline:
    """FramePack's pipeline, random weights: Llama (2 layers, 16 wide) over a byte-level tokenizer, CLIP's pooled text,
    SigLIP over 32 x 32 px (4 image tokens), HunyuanVideo's VAE (8x, 4x in time) at 8 channels, `tiny_framepack`."""
    from test_new_families import write_qwen_tokenizer

    tokenizer = write_qwen_tokenizer(folder / "llama")
    torch.manual_seed(0)
    text_encoder = LlamaModel(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=FP_TEXT_DIM, intermediate_size=37, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ).eval()  # fmt: skip
    tokenizer_2 = write_clip_tokenizer(folder / "clip", max_length=77)
    torch.manual_seed(0)
    text_encoder_2 = CLIPTextModel(
        CLIPTextConfig(vocab_size=len(tokenizer_2), hidden_size=FP_POOLED, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                       pad_token_id=1)
    ).eval()  # fmt: skip
    torch.manual_seed(0)
    image_encoder = SiglipVisionModel(
        SiglipVisionConfig(hidden_size=FP_IMAGE_DIM, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16)
    ).eval()  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=8, temporal_compression_ratio=4,
    ).eval()  # fmt: skip
    pipe = HunyuanVideoFramepackPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_framepack(),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        image_encoder=image_encoder,
        feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32}),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def framepack_image() -> PIL.Image.Image:
    """The image FramePack animates: 96 x 128 px of seeded noise."""
    pixels = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


#: The table's split of a batch cuts every tensor whose first axis is 2, FramePack's 1-D frame indices of the 2-frame
#: histories among them: tests/test_lumina_dit.py checks each sample.
FP_NOT_INDEPENDENT = "the 2-frame histories' 1-D frame indices would be split too: tests/test_lumina_dit.py checks it"
#: Captions of different valid lengths: the model pads each sample's sequence after its image tokens and masks it, so
#: the main layers run unmerged in the batch and merged in each sample alone.
LUMINA2_MASKED = "captions of different lengths: the main layers merge in each sample alone, not in the padded batch"


CASES = (
    FamilyCase(
        name="lumina2",
        family="lumina2",
        build=tiny_lumina2,
        inputs=lumina2_inputs,
        merged_calls=3,  # the noise refiner's block and both main layers; never the context refiner
        set_attn_processor=False,  # the model has no set_attn_processor: apply_tome and enable_tome only
        pipeline=PipelineCase(
            build=tiny_lumina2_pipeline,
            call_kwargs={
                "prompt": "a cat",
                "system_prompt": "Draw",  # short: the prompt is padded to max_sequence_length
                "height": 96,
                "width": 128,
                "num_inference_steps": 2,
                "guidance_scale": 4.0,
                "max_sequence_length": 32,
                "output_type": "latent",
            },
            height=96,
            width=128,
        ),
    ),
    FamilyCase(
        name="lumina2-padded",
        family="lumina2",
        build=tiny_lumina2,
        inputs=lambda batch=2: lumina2_inputs(batch, valid=(5,) * batch),  # both captions 5 valid tokens: no mask
        merged_calls=3,
        set_attn_processor=False,  # the model has no set_attn_processor: apply_tome and enable_tome only
    ),
    FamilyCase(
        name="lumina2-uneven",
        family="lumina2",
        build=tiny_lumina2,
        inputs=lambda batch=2: lumina2_inputs(batch, valid=(TEXT, 4)[:batch]),
        merged_calls=1,  # the noise refiner alone: the main layers get the padding mask and run unmerged
        set_attn_processor=False,  # the model has no set_attn_processor: apply_tome and enable_tome only
        batch_independent=False,
        why_not_independent=LUMINA2_MASKED,
    ),
    FamilyCase(
        name="lumina-next",
        family="lumina_next",
        build=tiny_lumina_next,
        inputs=lumina_next_inputs,
        merged_calls=2,  # each layer's self-attention (the cross-attention only with merge_crossattn)
        set_attn_processor=False,  # the model has no set_attn_processor: apply_tome and enable_tome only
        pipeline=PipelineCase(
            build=tiny_lumina_next_pipeline,
            call_kwargs={
                "prompt": "a cat",
                # Not empty: the byte-level tokenizer adds no start token as Gemma's does, and an empty prompt's mask
                # (all zeros) would make the caption's mean NaN.
                "negative_prompt": "blurry",
                "height": 96,
                "width": 128,
                "num_inference_steps": 2,
                "guidance_scale": 4.0,
                "clean_caption": False,
                "output_type": "latent",
            },
            height=96,
            width=128,
        ),
    ),
    FamilyCase(
        name="auraflow",
        family="auraflow",
        build=tiny_auraflow,
        inputs=auraflow_inputs,
        merged_calls=2,  # the joint block and the single-stream block
        pipeline=PipelineCase(
            build=tiny_auraflow_pipeline,
            call_kwargs={
                "prompt": "a cat",
                "height": 96,
                "width": 128,
                "num_inference_steps": 2,
                "max_sequence_length": 16,
                "output_type": "latent",
            },
            height=96,
            width=128,
        ),
    ),
    FamilyCase(
        name="dit",
        family="dit_imagenet",
        build=tiny_dit,
        inputs=dit_inputs,
        merged_calls=2,  # each block's self-attention
        set_attn_processor=False,  # the model has no set_attn_processor: apply_tome and enable_tome only
        pipeline=PipelineCase(
            build=tiny_dit_pipeline,
            call_kwargs={"class_labels": [3], "num_inference_steps": 2, "guidance_scale": 4.0, "output_type": "pt"},
            height=96,  # the model's sample_size (12 latent pixels) at 8x
            width=96,
        ),
    ),
    FamilyCase(
        name="hunyuandit",
        family="hunyuandit",
        build=tiny_hunyuandit,
        inputs=hunyuandit_inputs,
        merged_calls=4,  # each block's self-attention (the cross-attention only with merge_crossattn)
        pipeline=PipelineCase(
            build=tiny_hunyuandit_pipeline,
            call_kwargs={
                "prompt": "a cat",
                "height": 96,
                "width": 128,
                "num_inference_steps": 2,
                "use_resolution_binning": False,
                "output_type": "latent",
            },
            height=96,
            width=128,
        ),
    ),
    FamilyCase(
        name="hunyuanvideo-framepack",
        family="hunyuanvideo_framepack",
        build=tiny_framepack,
        inputs=framepack_inputs,
        merged_calls=2,  # the double- and the single-stream block; never the token refiner
        set_attn_processor=False,  # the model has no set_attn_processor: apply_tome and enable_tome only
        batch_independent=False,
        why_not_independent=FP_NOT_INDEPENDENT,
        pipeline=PipelineCase(
            build=tiny_framepack_pipeline,
            call_kwargs={
                "image": framepack_image(),
                "prompt": "a cat walks",
                "prompt_template": {"template": "{}", "crop_start": 0},
                "height": 96,
                "width": 128,
                "num_frames": 5,  # one section of latent_window_size 2: 5 frames
                "latent_window_size": 2,
                "num_inference_steps": 2,
                "max_sequence_length": 16,
                "output_type": "pt",
            },
            height=96,
            width=128,
            num_frames=5,
        ),
    ),
)
