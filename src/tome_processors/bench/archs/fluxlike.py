"""The FLUX-like successors on the bench: Krea 2 (`krea2`), FLUX.3 (`flux3`) and LongCat-Image (`longcat_image`).

Each model gets packed tokens (2 x 2 latent pixels of an 8x VAE: 16 px a token) and its rotary ids as its pipeline
builds them; the timestep is the pipelines' `t / 1000`.

Example:
    >>> from tome_processors.bench.dit import build_transformer, make_transformer_inputs
    >>> model = build_transformer("longcat_image", quick=True)
    >>> inputs = make_transformer_inputs(model, "longcat_image", batch=1, resolution=64, text_tokens=5)
    >>> tuple(inputs.kwargs["img_ids"][0].tolist()), tuple(inputs.run(model).shape)
    ((1.0, 512.0, 512.0), (1, 16, 16))
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Flux3Transformer2DModel, Krea2Transformer2DModel, LongCatImageTransformer2DModel

from . import Arch, ArchInputs

#: Pixels per latent pixel of the three VAEs (the Qwen-Image VAE, FLUX.2's, LongCat's FLUX.1-style one).
SPACE_STRIDE = 8
#: Latent pixels per token side: every pipeline packs 2 x 2 latent pixels into one token.
PACK = 2


def _grid_ids(a: ArchInputs, columns: int, start: int = 0, time: float = 0.0) -> torch.Tensor:
    """`(h * w, columns)` ids of the packed token grid: time in column 0, rows and columns in 1 and 2 from `start`."""
    h, w = a.shape.height // PACK, a.shape.width // PACK
    ids = torch.zeros(h, w, columns, device=a.device)
    ids[..., 0] = time
    ids[..., 1] = torch.arange(h, device=a.device)[:, None] + start
    ids[..., 2] = torch.arange(w, device=a.device)[None] + start
    return ids.view(h * w, columns)


def _timestep(a: ArchInputs) -> torch.Tensor:
    return torch.full((a.shape.batch,), 0.5, device=a.device, dtype=a.dtype)


def krea2_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `Krea2Pipeline` calls the model: the text's tapped encoder layers, `position_ids` over the text (zeros) then
    the image, and the prompt's mask (a prompt of a quarter of the padded length, then padding, then the template's
    5 suffix tokens)."""
    config, shape = a.config, a.shape
    tokens, text = shape.tokens(PACK), shape.text_tokens
    mask = torch.zeros(shape.batch, text, dtype=torch.bool, device=a.device)
    mask[:, : max(1, text // 4)] = True
    mask[:, max(0, text - 5) :] = True
    return {
        "hidden_states": a.randn(shape.batch, tokens, config.in_channels),
        "encoder_hidden_states": a.randn(shape.batch, text, config.num_text_layers, config.text_hidden_dim),
        "timestep": _timestep(a),
        "position_ids": torch.cat([torch.zeros(text, 3, device=a.device), _grid_ids(a, 3)]),
        "encoder_attention_mask": mask,
    }


def flux3_inputs(a: ArchInputs) -> dict[str, Any]:
    """As its forward's docstring asks (no pipeline in diffusers yet), the ids as FLUX.2's pipeline builds them:
    `(t, h, w, l)`, the text's numbered along `l`; text to image, no reference image."""
    config, shape = a.config, a.shape
    text_ids = torch.zeros(shape.text_tokens, 4, device=a.device)
    text_ids[:, 3] = torch.arange(shape.text_tokens, device=a.device)
    return {
        "hidden_states": a.randn(shape.batch, shape.tokens(PACK), config.in_channels),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.joint_attention_dim),
        "timestep": _timestep(a),
        "img_ids": _grid_ids(a, 4),
        "txt_ids": text_ids,
    }


def longcat_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `LongCatImagePipeline` calls the model: text ids `(0, i, i)`, image ids `(1, 512 + row, 512 + column)`
    (after its 512 text positions)."""
    config, shape = a.config, a.shape
    text_ids = torch.zeros(shape.text_tokens, 3, device=a.device)
    text_ids[:, 1] = text_ids[:, 2] = torch.arange(shape.text_tokens, device=a.device)
    return {
        "hidden_states": a.randn(shape.batch, shape.tokens(PACK), config.in_channels),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.joint_attention_dim),
        "timestep": _timestep(a),
        "img_ids": _grid_ids(a, 3, start=512, time=1.0),
        "txt_ids": text_ids,
    }


# Krea 2 (about 12 B in its blocks): 28 single-stream blocks, 48 query and 12 key/value heads of 128 (6144 wide),
# SwiGLU of 16384; Qwen3-VL-4B's 2560-wide text from 12 tapped layers. No published config yet (Krea2Pipeline's docs:
# "no hub repo yet"): the class's defaults, which its docstring describes as the Krea 2 checkpoint's.
KREA2_FULL: dict[str, Any] = dict(
    in_channels=64,
    num_layers=28,
    attention_head_dim=128,
    num_attention_heads=48,
    num_key_value_heads=12,
    intermediate_size=16384,
    timestep_embed_dim=256,
    text_hidden_dim=2560,
    num_text_layers=12,
    text_num_attention_heads=20,
    text_num_key_value_heads=20,
    text_intermediate_size=6912,
    num_layerwise_text_blocks=2,
    num_refiner_text_blocks=2,
    axes_dims_rope=(32, 48, 48),
    rope_theta=1000.0,
)
# FLUX.3: 5 per-mode blocks per mode and 28 single-stream blocks, 24 heads of 128 (3072 wide); stacked Qwen3-VL
# hidden states (20480 wide) as text. No published weights or pipeline yet: the class's defaults (inferred).
FLUX3_FULL: dict[str, Any] = dict(
    in_channels=128,
    cond_in_channels=128,
    num_layers=5,
    num_single_layers=28,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=20480,
    timestep_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
)
# LongCat-Image (6 B, diffusers' pipeline docs): 10 double- and 20 single-stream blocks, 24 heads of 128 (3072 wide);
# Qwen2.5-VL-7B's 3584-wide text. The depth is the released weights' as mflux's port of them declares it (the
# class's defaults, 19 and 38 blocks, are FLUX.1-dev's 12 B); the rest the class's defaults.
LONGCAT_FULL: dict[str, Any] = dict(
    patch_size=1,
    in_channels=64,
    num_layers=10,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    pooled_projection_dim=3584,
    axes_dims_rope=(16, 56, 56),
)

ARCHS = (
    Arch(
        name="krea2",
        model_class=Krea2Transformer2DModel,
        full=KREA2_FULL,
        quick=dict(KREA2_FULL, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16,
                   num_text_layers=3, text_num_attention_heads=2, text_num_key_value_heads=1,
                   text_intermediate_size=16, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
                   axes_dims_rope=(4, 2, 2)),
        text_tokens=512,  # Krea2Pipeline pads the prompt to max_sequence_length (512) inside its template
        inputs=krea2_inputs,
        # Its text fusion's blocks (over 12 tapped layers of each of 512 text tokens) run once a forward, two of each
        # kind for 28 image blocks: `--layers` caps them too, or one image block's forward would be a third fusion.
        depth_fields=("num_layers", "num_layerwise_text_blocks", "num_refiner_text_blocks"),
        space_stride=SPACE_STRIDE,
        notes="single-stream blocks over text then image; a key-padding mask over the text",
    ),
    Arch(
        name="flux3",
        model_class=Flux3Transformer2DModel,
        full=FLUX3_FULL,
        quick=dict(FLUX3_FULL, in_channels=16, cond_in_channels=16, num_layers=1, num_single_layers=2,
                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, timestep_channels=32,
                   axes_dims_rope=(4, 4, 4, 4)),
        text_tokens=512,  # no pipeline yet: FLUX.2's padded prompt length (inferred)
        inputs=flux3_inputs,
        space_stride=SPACE_STRIDE,
        notes="per-mode blocks (the image's merged), then single-stream blocks over text and image",
    ),
    Arch(
        name="longcat_image",
        model_class=LongCatImageTransformer2DModel,
        full=LONGCAT_FULL,
        quick=dict(LONGCAT_FULL, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
        text_tokens=512,  # LongCatImagePipeline pads every prompt to its tokenizer_max_length, 512
        inputs=longcat_inputs,
        space_stride=SPACE_STRIDE,
        notes="FLUX.1's blocks; image ids from row and column 512",
    ),
)  # fmt: skip
