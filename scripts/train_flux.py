"""Train the small FLUX-shaped diffusion transformer shipped in `tome_processors/data/flux_denoiser/`.

The shape of FLUX.1 and Qwen-Image, which the PixArt-shaped DiT lacks: diffusers' own
`FluxTransformer2DModel` with double-stream blocks (text and image in one joint attention, separate
weights) then single-stream blocks (one sequence of text then image), rotary positions on three axes,
timestep and pooled-text modulation. It learns DDPM epsilon-prediction in pixel space: 2x2 pixel patches
packed into 12-channel tokens as FLUX's pipelines pack latents (`quality.pack_image`), the same 8-token
fixed context as the other denoisers as its "text" (mean-pooled for the pooled projection), the same
photo split, noise schedule and training loop (`train_denoiser.fit`). A 64x64 crop is a 32x32 grid of
1,024 image tokens, the size it is measured at; rotary positions do not stretch with the grid, so it
could train on smaller crops, but it is kept at the measured size like the DiT.

Example:
    $ python scripts/train_flux.py --seed 0
    step 1000/1000  loss 0.0xxx  ...
"""

from __future__ import annotations

import argparse

import torch
from diffusers import FluxTransformer2DModel
from train_denoiser import CROSS_DIM, add_arguments, fit, print_summary, save

from tome_processors.bench.quality import PACK, context_embedding, predict_noise

WIDTH = 128
HEADS = 4
DEFAULT_OUT = "src/tome_processors/data/flux_denoiser"


def build_flux() -> FluxTransformer2DModel:
    """FLUX.1's block structure at a small size: 2 double- and 4 single-stream blocks of width 128 (4 heads
    of 32, rotary axes of 8 + 12 + 12 channels), 2x2 RGB patches in and out."""
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=3 * PACK * PACK,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=WIDTH // HEADS,
        num_attention_heads=HEADS,
        joint_attention_dim=CROSS_DIM,
        pooled_projection_dim=CROSS_DIM,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )


def _predict(model: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: int) -> torch.Tensor:
    return predict_noise(model, noisy, timesteps, context_embedding(batch, CROSS_DIM))


def train(args: argparse.Namespace) -> dict:
    """Run the training and return what is recorded in `training.json`."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_flux()
    losses, wall = fit(model, _predict, args)
    return save(model, args, losses, wall)


def main() -> None:
    """Parse the arguments, train, and print the time and final loss."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, steps=1000, batch=4, crop=64, big_every=0, log_every=100, out=DEFAULT_OUT)
    print_summary(train(parser.parse_args()))


if __name__ == "__main__":
    main()
