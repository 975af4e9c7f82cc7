"""Train the small pixel-space diffusion transformer shipped in `tome_processors/data/dit_denoiser/`.

A `PixArtTransformer2DModel` (patch tokens, `ada_norm_single` timestep modulation, cross-attention to the
same fixed 8-token context as the UNet denoiser) learns DDPM epsilon-prediction on random RGB crops of
the photos bundled with scikit-image, with the UNet denoiser's split, noise schedule and training loop
(`train_denoiser.fit`). Patch size 2 on 64x64 pixels gives 32x32 = 1,024 tokens, the size it is measured at.

Every step uses 64x64 crops (unlike the UNet's mostly 32x32 ones): diffusers' `PatchEmbed` stretches its
sine-cosine positions over whatever grid it gets (PixArt sets no `pos_embed_max_size`), so a smaller crop
would see its tokens at another spacing than the measured size; and at this width a batch of four 64x64
crops took about as long as sixteen 32x32 ones (0.85 s against 0.8 s a step on one thread), so small crops
would not buy more pixels. Everything random comes from `--seed`; the run is reproducible on one thread.

Example:
    $ python scripts/train_dit.py --seed 0
    step 1500/1500  loss 0.0xxx  ...
"""

from __future__ import annotations

import argparse

import torch
from diffusers import PixArtTransformer2DModel
from train_denoiser import CROSS_DIM, add_arguments, fit, print_summary, save

from tome_processors.bench.quality import context_embedding

WIDTH = 128
HEADS = 4
DEFAULT_OUT = "src/tome_processors/data/dit_denoiser"


def build_dit() -> PixArtTransformer2DModel:
    """PixArt-α's block structure at a small size: 6 blocks of width 128 (4 heads of 32), patch 2, 3 channels."""
    return PixArtTransformer2DModel(
        num_attention_heads=HEADS,
        attention_head_dim=WIDTH // HEADS,
        in_channels=3,
        out_channels=3,  # epsilon only: no learned variance
        num_layers=6,
        cross_attention_dim=WIDTH,
        sample_size=64,  # pixels: the positional table is built for the measured 32x32 token grid
        patch_size=2,
        caption_channels=CROSS_DIM,  # the fixed context is projected to the width, as PixArt's T5 tokens are
        use_additional_conditions=False,
    )


def _predict(dit: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: int) -> torch.Tensor:
    return dit(noisy, encoder_hidden_states=context_embedding(batch, CROSS_DIM), timestep=timesteps).sample


def train(args: argparse.Namespace) -> dict:
    """Run the training and return what is recorded in `training.json`."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dit = build_dit()
    losses, wall = fit(dit, _predict, args)
    return save(dit, args, losses, wall)


def main() -> None:
    """Parse the arguments, train, and print the time and final loss."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Short pilots (the same number of crops) did better with batch 4 and twice the steps than with batch 8.
    add_arguments(parser, steps=1500, batch=4, crop=64, big_every=0, log_every=100, out=DEFAULT_OUT)
    print_summary(train(parser.parse_args()))


if __name__ == "__main__":
    main()
