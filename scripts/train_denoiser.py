"""Train the small pixel-space denoiser shipped in `tome_processors/data/denoiser/`.

A `UNet2DConditionModel` with the SD1.5 layout (cross-attention blocks on the two upper levels, none
at the bottom, narrow channels) learns DDPM epsilon-prediction on random RGB crops of photos bundled
with scikit-image, split by whole photo (`tome_processors.bench.photos.TRAIN_IMAGES` / `HELDOUT_IMAGES`).
Most steps use 32x32 crops (cheap); every `--big-every`-th step uses 64x64 crops so that the top level
also learns to attend over 4096 tokens, the size it is measured at. Everything random comes from
`--seed`; the run is reproducible on one thread.

Example:
    $ python scripts/train_denoiser.py --seed 0 --out src/tome_processors/data/denoiser
    step 700/700  loss 0.0xxx  ...
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from tome_processors.bench.photos import HELDOUT_IMAGES, TRAIN_IMAGES, load_photo
from tome_processors.bench.quality import context_embedding

CROSS_DIM = 32


def build_unet() -> UNet2DConditionModel:
    """The SD1.5 UNet structure at a small width: 3 levels (32, 64, 64), attention on the upper two."""
    return UNet2DConditionModel(
        sample_size=64,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=(2, 4, 4),  # number of heads per level in diffusers' naming: 16 channels each
        norm_num_groups=8,
        cross_attention_dim=CROSS_DIM,
    )


def build_scheduler() -> DDPMScheduler:
    """Stable Diffusion's noise schedule, so a timestep means the same noise level as in SD."""
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


def random_crops(photos: list[torch.Tensor], batch: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` crops of `size` x `size`: a photo chosen uniformly, a uniform position, a random flip."""
    crops = []
    for _ in range(batch):
        photo = photos[int(torch.randint(len(photos), (1,), generator=generator))]
        _, height, width = photo.shape
        top = int(torch.randint(height - size + 1, (1,), generator=generator))
        left = int(torch.randint(width - size + 1, (1,), generator=generator))
        crop = photo[:, top : top + size, left : left + size]
        if bool(torch.randint(2, (1,), generator=generator)):
            crop = crop.flip(-1)
        crops.append(crop)
    return torch.stack(crops)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of `peak`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


Predict = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""`predict(model, noisy, timesteps, batch)`: the model's noise prediction for a training batch."""

Draw = Callable[[list[torch.Tensor], int, int, torch.Generator], torch.Tensor]
"""`draw(photos, batch, size, generator)`: one training batch of clean samples (`random_crops` for images)."""


def fit(
    model: torch.nn.Module, predict: Predict, args: argparse.Namespace, draw: Draw = random_crops
) -> tuple[list[float], float]:
    """The training loop shared by every shipped denoiser: returns the per-step losses and the wall time.

    Small-crop steps use `args.crop` x `args.crop` crops in batches of `args.batch`; every `args.big_every`-th
    step uses `args.big` x `args.big` crops in batches of `args.big_batch`. The crops (or whatever `draw`
    makes of the training photos), noise and timesteps come from a generator seeded with `args.seed + 1`
    (the model is initialised from `args.seed` before).
    """
    model.train()
    scheduler = build_scheduler()
    photos = [load_photo(name) for name in TRAIN_IMAGES]
    generator = torch.Generator().manual_seed(args.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        big = args.big_every > 0 and step % args.big_every == args.big_every - 1
        size, batch = (args.big, args.big_batch) if big else (args.crop, args.batch)
        x0 = draw(photos, batch, size, generator)
        noise = torch.randn(x0.shape, generator=generator)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=generator)
        noisy = scheduler.add_noise(x0, noise, timesteps)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        loss = torch.nn.functional.mse_loss(predict(model, noisy, timesteps, batch), noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            elapsed = time.perf_counter() - start
            print(f"step {step + 1}/{args.steps}  loss {recent:.4f}  {elapsed:.0f}s", flush=True)
    return losses, time.perf_counter() - start


def save(model: torch.nn.Module, args: argparse.Namespace, losses: list[float], wall: float) -> dict:
    """Write the model, the scheduler and `training.json` to `args.out`; return the recorded run."""
    final = losses[-50:]
    record = {
        "command": "python " + " ".join(sys.argv),
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "crop": args.crop,
        "big_every": args.big_every,
        "big": args.big,
        "big_batch": args.big_batch,
        "lr": args.lr,
        "threads": args.threads,
        "train_images": list(TRAIN_IMAGES),
        "heldout_images": list(HELDOUT_IMAGES),
        "wall_time_s": round(wall, 1),
        "final_loss_mean_last_50_steps": round(sum(final) / len(final), 5),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # half() / float() rather than to(dtype): diffusers' ModelMixin.to warns on every dtype cast.
    (model.eval().half() if args.fp16 else model.eval().float()).save_pretrained(out, safe_serialization=True)
    build_scheduler().save_pretrained(out)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _predict_unet(unet: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: int) -> torch.Tensor:
    return unet(noisy, timesteps, encoder_hidden_states=context_embedding(batch, CROSS_DIM)).sample


def train(args: argparse.Namespace) -> dict:
    """Run the training and return what is recorded in `training.json`."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    unet = build_unet()
    losses, wall = fit(unet, _predict_unet, args)
    return save(unet, args, losses, wall)


def add_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """The training options, with `defaults` overriding the UNet's (e.g. `steps=900`)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=16, help="batch of the small-crop steps")
    parser.add_argument("--crop", type=int, default=32, help="side of the small crops")
    parser.add_argument("--big-every", type=int, default=10, help="every n-th step uses --big crops (0: never)")
    parser.add_argument("--big", type=int, default=64, help="side of the big crops (the measured size)")
    parser.add_argument("--big-batch", type=int, default=4, help="batch of the big-crop steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True, help="store weights in fp16")
    parser.add_argument("--out", default="src/tome_processors/data/denoiser")
    parser.set_defaults(**defaults)


def print_summary(record: dict) -> None:
    """Print a finished run's wall time and final loss (what `training.json` records)."""
    print(
        f"wall time {record['wall_time_s']:.0f} s, final loss (mean of last 50 steps) "
        f"{record['final_loss_mean_last_50_steps']:.4f}"
    )


def main() -> None:
    """Parse the arguments, train, and print the time and final loss."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    print_summary(train(parser.parse_args()))


if __name__ == "__main__":
    main()
