"""JoyImage-Edit (and Plus), OmniGen, Motif-Video, AnyFlow and DreamLite's transformer (`families/edit_more.py`).

Tiny random-weight models: diffusers' own test configs, at most 2 blocks a list. Inputs as each pipeline calls its
model: batch 2, a 6 x 8 token grid a frame, 7 text tokens; the edit models with a reference image's tokens beside the
generated image's (never merged). Tiny offline pipelines where diffusers has one whose text encoder builds tiny.
"""

from __future__ import annotations

import torch
from diffusers import (
    AnyFlowTransformer3DModel,
    DreamLiteTransformer2DModel,
    JoyImageEditPlusTransformer3DModel,
    JoyImageEditTransformer3DModel,
    MotifVideoTransformer3DModel,
    OmniGenTransformer2DModel,
)

from family_cases import FamilyCase

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


def tiny_motif_video() -> MotifVideoTransformer3DModel:
    """diffusers' test config with a DDT decoder block and the single-stream blocks' shared cross-attention (as the
    released model): one double-stream and 2 single-stream blocks, the last a decoder block."""
    torch.manual_seed(0)
    return MotifVideoTransformer3DModel(
        in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=1,
        num_single_layers=2, num_decoder_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=32,
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


CASES = (
    # The generated image's 6 x 8 tokens merge in both blocks; the reference's 48 pass through.
    FamilyCase("joyimage_edit", "joyimage_edit", tiny_joyimage, joyimage_inputs, merged_calls=2),
    # The text rotated too (its table passes as it is).
    FamilyCase("joyimage_edit_mrope", "joyimage_edit", lambda: tiny_joyimage("mrope"), joyimage_inputs,
               merged_calls=2),
    # References of two sizes, padded, and the mask over padding patches and text padding (cut).
    FamilyCase("joyimage_edit_plus", "joyimage_edit_plus", tiny_joyimage_plus, joyimage_plus_inputs, merged_calls=2,
               ),
    FamilyCase("omnigen", "omnigen", tiny_omnigen, omnigen_inputs, merged_calls=2, set_attn_processor=False),
    # A 2 x 2 input image's tokens in the prompt: rows of their own.
    FamilyCase("omnigen_edit", "omnigen", tiny_omnigen, lambda batch=2: omnigen_inputs(batch, reference=(2, 2)),
               merged_calls=2, set_attn_processor=False, batch_independent=False,
               why_not_independent="input_image_sizes numbers samples, which a slice of the batch does not renumber"),
    # The double-stream, the single-stream and the decoder block (the shared cross-attention is not merged).
    FamilyCase("motif_video", "motif_video", tiny_motif_video, motif_video_inputs, merged_calls=3),
    FamilyCase("anyflow", "anyflow", tiny_anyflow, anyflow_inputs, merged_calls=2, set_attn_processor=False),
    FamilyCase("dreamlite", "dreamlite", tiny_dreamlite, dreamlite_inputs, merged_calls=2, set_attn_processor=False),
)  # fmt: skip
