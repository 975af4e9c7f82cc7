"""Stable Video Diffusion's UNet and fixed inputs for `tome-processors bench --arch svd`.

The architecture is the published `stable-video-diffusion-img2vid` UNet (`UNetSpatioTemporalConditionModel`:
channels 320/640/1280/1280, heads 5/10/20/20, a 1024-wide CLIP image embedding, 14 frames) with random
weights; "tiny" has its layout (spatio-temporal transformers at the first level) at widths that run in
milliseconds. The inputs are one forward of the pipeline's denoising loop: `batch` videos (2 = one video
with guidance) of `frames` latent frames, each `resolution / 8` latent pixels square. A 768 px square has
the token count of the pipeline's 576x1024 clip (96 x 96 = 72 x 128 = 9,216 per frame).

Example:
    >>> unet = build_svd_unet("tiny")
    >>> inputs = make_svd_inputs(unet, batch=2, resolution=64, frames=3)
    >>> tuple(inputs.sample.shape), tuple(inputs.run(unet).shape)
    ((2, 3, 8, 8, 8), (2, 3, 4, 8, 8))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import UNetSpatioTemporalConditionModel

__all__ = ["SVD_ARCHITECTURES", "SVDInputs", "build_svd_unet", "make_svd_inputs"]

_SVD: dict[str, Any] = dict(
    sample_size=96,
    in_channels=8,
    out_channels=4,
    down_block_types=(
        "CrossAttnDownBlockSpatioTemporal",
        "CrossAttnDownBlockSpatioTemporal",
        "CrossAttnDownBlockSpatioTemporal",
        "DownBlockSpatioTemporal",
    ),
    up_block_types=(
        "UpBlockSpatioTemporal",
        "CrossAttnUpBlockSpatioTemporal",
        "CrossAttnUpBlockSpatioTemporal",
        "CrossAttnUpBlockSpatioTemporal",
    ),
    block_out_channels=(320, 640, 1280, 1280),
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=768,
    layers_per_block=2,
    cross_attention_dim=1024,
    transformer_layers_per_block=1,
    num_attention_heads=(5, 10, 20, 20),
    num_frames=14,
)
# diffusers' test config: the same block layout at the first level, 32 channels.
_TINY: dict[str, Any] = dict(
    sample_size=16,
    in_channels=8,
    out_channels=4,
    down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
    up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
    block_out_channels=(32, 64),
    addition_time_embed_dim=32,
    projection_class_embeddings_input_dim=96,
    layers_per_block=2,
    cross_attention_dim=32,
    num_attention_heads=8,
    num_frames=4,
)

#: Architecture name -> `UNetSpatioTemporalConditionModel` config ("tiny" for `--quick`).
SVD_ARCHITECTURES: dict[str, dict[str, Any]] = {"svd": _SVD, "tiny": _TINY}


def build_svd_unet(arch: str = "svd", seed: int = 0) -> UNetSpatioTemporalConditionModel:
    """An SVD UNet of the named architecture with random weights (seeded), in eval mode.

    Example:
        >>> build_svd_unet("tiny").config.num_frames
        4
    """
    if arch not in SVD_ARCHITECTURES:
        raise ValueError(f"Expected arch among {sorted(SVD_ARCHITECTURES)}, but got {arch!r}.")
    torch.manual_seed(seed)
    return UNetSpatioTemporalConditionModel(**SVD_ARCHITECTURES[arch]).eval()


@dataclass
class SVDInputs:
    """Fixed inputs of one SVD UNet forward, the same for every method.

    Attributes:
        sample: `(B, frames, 8, H/8, W/8)`: the noisy latents and the conditioning image's latent.
        timestep: a scalar tensor, SVD's `0.25 * log(sigma)` (0.5 is sigma 7.4, early in the schedule).
        encoder_hidden_states: `(B, 1, cross_attention_dim)`: the CLIP image embedding.
        added_time_ids: `(B, 3)`: fps - 1, motion bucket, noise augmentation (the pipeline's defaults).
    """

    sample: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    added_time_ids: torch.Tensor

    def run(self, unet: torch.nn.Module) -> torch.Tensor:
        """One forward (positional `sample`, as the pipeline calls it); returns the output sample."""
        with torch.inference_mode():
            return unet(
                self.sample,
                self.timestep,
                encoder_hidden_states=self.encoder_hidden_states,
                added_time_ids=self.added_time_ids,
            ).sample


def make_svd_inputs(
    unet: UNetSpatioTemporalConditionModel,
    batch: int,
    resolution: int,
    frames: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> SVDInputs:
    """Random fixed inputs for `unet`: `batch` clips of `frames` (default the model's `num_frames`) at `resolution` px.

    Example:
        >>> make_svd_inputs(build_svd_unet("tiny"), batch=1, resolution=64).sample.shape
        torch.Size([1, 4, 8, 8, 8])
    """
    config = unet.config
    frames = int(config.num_frames) if frames is None else frames
    if frames < 1:
        raise ValueError(f"Expected frames >= 1, but got {frames}.")
    side = resolution // 8
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, frames, config.in_channels, side, side, generator=g)
    image = torch.randn(batch, 1, int(config.cross_attention_dim), generator=g)
    time_ids = torch.tensor([6.0, 127.0, 0.02]).repeat(batch, 1)  # fps 7 - 1, motion bucket 127, noise 0.02
    return SVDInputs(
        sample=sample.to(device, dtype),
        timestep=torch.tensor(0.5, device=device),
        encoder_hidden_states=image.to(device, dtype),
        added_time_ids=time_ids.to(device, dtype),
    )
