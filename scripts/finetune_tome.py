"""Does training with token merging cost quality? Fine-tune the shipped UNet denoiser with and without ToMe.

Two runs from the same weights (the shipped denoiser, `tome_processors/data/denoiser/`) and the same seed, so
both see the same crops, noise and timesteps step for step: one plain, one with `apply_tome(unet,
preset=PRESET)` on during training. Both are then measured without ToMe, as a model is used after training,
on held-out photos (`bench.photos.HELDOUT_IMAGES`): the noise-prediction MSE over fixed crops, fixed noise and
timesteps 50, 150, ..., 950. The training crops are 64x64 (4,096 tokens at the top level, where the UNet's
presets act), from the photos the denoiser was trained on.

`--lora RANK` trains a LoRA on the attention projections (`bench.training.add_lora`) instead of every weight.

The two runs can go in two processes (`--run plain`, `--run tome`, each with `--json`), and `--combine` prints
the files' table.

Example:
    $ python scripts/finetune_tome.py --steps 150 --json finetune.json
    held-out loss (no ToMe at evaluation): shipped 0.0xxx, plain 0.0xxx, balanced 0.0xxx (+x.xx%)
    $ python scripts/finetune_tome.py --combine plain.json tome.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import diffusers
import torch
from train_denoiser import CROSS_DIM, random_crops

from tome_processors import apply_tome, remove_tome
from tome_processors.bench.photos import TRAIN_IMAGES, heldout_crops, load_photo
from tome_processors.bench.quality import context_embedding, load_denoiser
from tome_processors.bench.training import add_lora

EVAL_TIMESTEPS = tuple(range(50, 1000, 100))


def heldout_loss(unet: torch.nn.Module, scheduler, crops: torch.Tensor, seed: int) -> dict[int, float]:
    """Noise-prediction MSE on `crops` per timestep, fixed noise from `seed` (the same for every model)."""
    generator = torch.Generator().manual_seed(seed)
    context = context_embedding(crops.shape[0], CROSS_DIM)
    losses = {}
    unet.eval()
    with torch.no_grad():
        for t in EVAL_TIMESTEPS:
            noise = torch.randn(crops.shape, generator=generator)
            timesteps = torch.full((crops.shape[0],), t)
            noisy = scheduler.add_noise(crops, noise, timesteps)
            prediction = unet(noisy, timesteps, encoder_hidden_states=context).sample
            losses[t] = float(torch.nn.functional.mse_loss(prediction, noise))
    return losses


def finetune(args: argparse.Namespace, preset: str | None) -> tuple[torch.nn.Module, list[float], float]:
    """Fine-tune a fresh copy of the shipped denoiser; ToMe (`preset`) on during training when given."""
    unet, scheduler = load_denoiser("unet")
    if args.lora:
        params = add_lora(unet, rank=args.lora, seed=args.seed)
    else:
        params = list(unet.parameters())
    if preset is not None:
        apply_tome(unet, preset=preset)
    photos = [load_photo(name) for name in TRAIN_IMAGES]
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    context = context_embedding(args.batch, CROSS_DIM)
    losses = []
    start = time.perf_counter()
    unet.train()
    for step in range(args.steps):
        x0 = random_crops(photos, args.batch, args.crop, generator)
        noise = torch.randn(x0.shape, generator=generator)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (args.batch,), generator=generator)
        noisy = scheduler.add_noise(x0, noise, timesteps)
        prediction = unet(noisy, timesteps, encoder_hidden_states=context).sample
        loss = torch.nn.functional.mse_loss(prediction, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = losses[-args.log_every :]
            label = preset or "plain"
            print(
                f"{label}: step {step + 1}/{args.steps}  loss {sum(recent) / len(recent):.4f}  "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
    if preset is not None:
        remove_tome(unet)  # measured as it is used after training: without ToMe
    return unet, losses, time.perf_counter() - start


def table(results: dict[str, dict], preset: str) -> str:
    """The held-out losses as a markdown table, then the line comparing the two fine-tuned models."""
    mean = {name: sum(v.values()) / len(v) for name, v in results.items()}
    lines = ["| model | held-out loss (mean) | " + " | ".join(f"t={t}" for t in EVAL_TIMESTEPS) + " |"]
    lines.append("|---|---|" + "---|" * len(EVAL_TIMESTEPS))
    for name, values in results.items():
        cells = " | ".join(f"{values[int(t)]:.5f}" for t in EVAL_TIMESTEPS)
        lines.append(f"| {name} | {mean[name]:.5f} | {cells} |")
    if "plain" in mean and preset in mean:
        change = 100.0 * (mean[preset] - mean["plain"]) / mean["plain"]
        lines += [
            "",
            f"held-out loss (no ToMe at evaluation): shipped {mean['shipped']:.5f}, plain {mean['plain']:.5f}, "
            f"{preset} {mean[preset]:.5f} ({change:+.2f}% against plain)",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="balanced", help="the ToMe preset on during the second run")
    parser.add_argument("--run", choices=["both", "plain", "tome"], default="both", help="which fine-tune(s) to run")
    parser.add_argument("--combine", nargs="+", default=None, metavar="JSON", help="print the runs of these files")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--crop", type=int, default=64, help="side of the training crops (64: 4,096 top-level tokens)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lora", type=int, default=0, help="train a LoRA of this rank instead of every weight (0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-crops", type=int, default=4, help="held-out crops per held-out photo")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.combine:
        results: dict[str, dict] = {}
        for path in args.combine:
            record = json.loads(Path(path).read_text())
            results.update({k: {int(t): v for t, v in r.items()} for k, r in record["heldout_loss"].items()})
        print(table(results, args.preset))
        return

    crops = heldout_crops(64, args.eval_crops, seed=0)
    shipped, scheduler = load_denoiser("unet")
    results = {"shipped": heldout_loss(shipped, scheduler, crops, args.seed + 1)}
    runs = {}
    presets = {"both": (None, args.preset), "plain": (None,), "tome": (args.preset,)}[args.run]
    for preset in presets:
        unet, losses, wall = finetune(args, preset)
        label = preset or "plain"
        results[label] = heldout_loss(unet, scheduler, crops, args.seed + 1)
        runs[label] = {"train_loss_last_20": sum(losses[-20:]) / len(losses[-20:]), "wall_s": round(wall, 1)}
        if preset is not None:  # also how the ToMe-trained model does with ToMe on (as it was trained)
            apply_tome(unet, preset=preset)
            results[f"{label}, ToMe on at evaluation"] = heldout_loss(unet, scheduler, crops, args.seed + 1)
            remove_tome(unet)
    print()
    print(table(results, args.preset))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "command": "python " + " ".join(sys.argv),
        "commit": commit,
        "args": vars(args),
        "heldout_loss": results,
        "runs": runs,
        "machine": f"{platform.platform()}; {platform.processor()}",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
