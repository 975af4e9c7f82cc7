"""UNets and fixed inputs for `tome-processors bench`: real UNet architectures with random weights, or a user's.

Nothing is downloaded unless `--model` names a hub id. The architectures follow the published configs of
Stable Diffusion 1.5, 2.x and XL (channels, heads, cross-attention width, transformer depth); their weights
are diffusers' random initialisation, so speed and memory are those of the real model, while the output
change measures how far merging moves an untrained network, not image quality.

Example:
    >>> unet = build_unet("tiny")
    >>> inputs = make_inputs(unet, batch=2, resolution=64)
    >>> tuple(inputs.sample.shape)
    (2, 4, 8, 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import UNet2DConditionModel

__all__ = ["ARCHITECTURES", "UNetInputs", "build_unet", "load_unet", "make_inputs"]

_SD15: dict[str, Any] = dict(
    sample_size=64,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=2,
    cross_attention_dim=768,
    attention_head_dim=8,
)
_SD2: dict[str, Any] = dict(
    _SD15,
    sample_size=96,
    cross_attention_dim=1024,
    attention_head_dim=(5, 10, 20, 20),
    use_linear_projection=True,
)
_SDXL: dict[str, Any] = dict(
    sample_size=128,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=2,
    transformer_layers_per_block=(1, 2, 10),
    cross_attention_dim=2048,
    attention_head_dim=(5, 10, 20),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
# Same block layout as SD1.5 (attention at the first two levels), tiny widths: a forward takes milliseconds.
_TINY: dict[str, Any] = dict(
    sample_size=32,
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1,
    norm_num_groups=8,
    cross_attention_dim=32,
    attention_head_dim=8,
)
_TINY_XL: dict[str, Any] = dict(
    _TINY,
    block_out_channels=(32, 64, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4, 8),
    use_linear_projection=True,
    transformer_layers_per_block=(1, 1, 2),
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=32 + 6 * 8,
)

#: Architecture name -> `UNet2DConditionModel` config. "tiny" / "tiny-sdxl" are for `--quick`.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "sd15": _SD15,
    "sd2": _SD2,
    "sdxl": _SDXL,
    "tiny": _TINY,
    "tiny-sdxl": _TINY_XL,
}

#: Text tokens of the cross-attention context (CLIP's 77).
TEXT_TOKENS = 77


def build_unet(arch: str, seed: int = 0) -> UNet2DConditionModel:
    """A UNet of the named architecture with random weights (seeded), in eval mode.

    Example:
        >>> tuple(build_unet("tiny").config.block_out_channels)
        (32, 64)
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"Expected arch among {sorted(ARCHITECTURES)}, but got {arch!r}.")
    torch.manual_seed(seed)
    return UNet2DConditionModel(**ARCHITECTURES[arch]).eval()


def load_unet(model: str, dtype: torch.dtype | None = None) -> UNet2DConditionModel:
    """A UNet from a local folder or hub id: a pipeline (with a `unet/` subfolder) or a UNet folder itself.

    Example:
        >>> unet = load_unet("stable-diffusion-v1-5/stable-diffusion-v1-5")  # doctest: +SKIP
    """
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    folder = Path(model)
    if folder.is_dir():
        if (folder / "unet").is_dir():
            return UNet2DConditionModel.from_pretrained(folder, subfolder="unet", **kwargs).eval()
        return UNet2DConditionModel.from_pretrained(folder, **kwargs).eval()
    try:  # a hub id: most are pipelines
        return UNet2DConditionModel.from_pretrained(model, subfolder="unet", **kwargs).eval()
    except (OSError, ValueError):
        return UNet2DConditionModel.from_pretrained(model, **kwargs).eval()


@dataclass
class UNetInputs:
    """Fixed inputs of one UNet forward, the same for every method.

    Attributes:
        sample: `(B, in_channels, H/8, W/8)` latent.
        timestep: a scalar tensor (500, the middle of the schedule).
        encoder_hidden_states: `(B, 77, cross_attention_dim)` text context.
        added_cond_kwargs: SDXL's `text_embeds` and `time_ids`, or None.
    """

    sample: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    added_cond_kwargs: dict[str, torch.Tensor] | None = None

    def run(self, unet: torch.nn.Module) -> torch.Tensor:
        """One forward (positional `sample`, as tomesd's hook needs); returns the output sample."""
        with torch.inference_mode():
            return unet(
                self.sample,
                self.timestep,
                encoder_hidden_states=self.encoder_hidden_states,
                added_cond_kwargs=self.added_cond_kwargs,
            ).sample


def _cross_dim(config: Any) -> int:
    dim = config.cross_attention_dim
    return int(dim[0] if isinstance(dim, (list, tuple)) else dim)


def make_inputs(
    unet: UNet2DConditionModel,
    batch: int,
    resolution: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> UNetInputs:
    """Random fixed inputs for `unet` at `resolution` pixels (latent side `resolution // 8`).

    Example:
        >>> make_inputs(build_unet("tiny-sdxl"), batch=1, resolution=64).added_cond_kwargs["time_ids"].shape
        torch.Size([1, 6])
    """
    config = unet.config
    side = resolution // 8
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, config.in_channels, side, side, generator=g)
    text = torch.randn(batch, TEXT_TOKENS, _cross_dim(config), generator=g)
    added = None
    if config.addition_embed_type == "text_time":
        time_dims = 6 * int(config.addition_time_embed_dim)
        text_embeds = torch.randn(batch, int(config.projection_class_embeddings_input_dim) - time_dims, generator=g)
        # original size, crop offset, `target_size`: what SDXL pipelines pass.
        time_ids = torch.tensor([resolution, resolution, 0, 0, resolution, resolution], dtype=torch.float32)
        added = {
            "text_embeds": text_embeds.to(device, dtype),
            "time_ids": time_ids.repeat(batch, 1).to(device, dtype),
        }
    return UNetInputs(
        sample=sample.to(device, dtype),
        timestep=torch.tensor(500, device=device),
        encoder_hidden_states=text.to(device, dtype),
        added_cond_kwargs=added,
    )
