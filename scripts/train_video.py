"""Train the small Wan-shaped video diffusion transformer shipped in `tome_processors/data/video_denoiser/`.

diffusers' own `WanTransformer3DModel` at a small size: 3-D patch tokens (1 frame x 2 x 2 pixels), 3-D
rotary positions (frames, rows, columns), self-attention over the whole clip, cross-attention to the same
fixed 8-token context as the other denoisers as its "text", timestep modulation. It learns DDPM
epsilon-prediction in pixel space on clips made from the bundled photos (`bench.clips`: camera pans,
zooms and an object moving over a still background), with the image denoisers' photo split, noise schedule
and training loop (`train_denoiser.fit`, here with clips instead of crops). A clip of 8 frames of 32x32
pixels is 8 x 16 x 16 = 2,048 tokens, the size it is measured at.

Example:
    $ python scripts/train_video.py --seed 0
    step 1000/1000  loss 0.0xxx  ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from train_denoiser import CROSS_DIM, add_arguments, fit, print_summary, save

from tome_processors.bench.clips import random_clips
from tome_processors.bench.quality import context_embedding, predict_noise

WIDTH = 128
HEADS = 4
DEFAULT_OUT = "src/tome_processors/data/video_denoiser"


def build_video_dit() -> WanTransformer3DModel:
    """Wan 2.1's block structure at a small size: 4 blocks of width 128 (4 heads of 32), feed-forward 512,
    patches of 1 x 2 x 2 RGB pixels."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=WIDTH // HEADS,
        in_channels=3,
        out_channels=3,
        text_dim=CROSS_DIM,
        freq_dim=64,
        ffn_dim=4 * WIDTH,
        num_layers=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    )


def _predict(model: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: int) -> torch.Tensor:
    return predict_noise(model, noisy, timesteps, context_embedding(batch, CROSS_DIM))


def train(args: argparse.Namespace) -> dict:
    """Run the training and return what is recorded in `training.json` (with the clip's frames)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_video_dit()

    def clips(photos: list[torch.Tensor], batch: int, size: int, generator: torch.Generator) -> torch.Tensor:
        return random_clips(photos, batch, args.frames, size, generator)

    losses, wall = fit(model, _predict, args, draw=clips)
    record = save(model, args, losses, wall)
    record["frames"] = args.frames
    (Path(args.out) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    """Parse the arguments, train, and print the time and final loss."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=8, help="frames of every training clip")
    add_arguments(parser, steps=1000, batch=2, crop=32, big_every=0, log_every=100, out=DEFAULT_OUT)
    print_summary(train(parser.parse_args()))


if __name__ == "__main__":
    main()
