"""Output change and flicker of ToMe settings on a video transformer, for choosing Wan's presets.

A random-weight Wan2.1-1.3B-width transformer (`layers` blocks) denoises a noisy panning clip: a smooth
random scene moved two latent pixels per frame, mixed with noise at `sigma`. For each setting it prints

- change: `||out - out_ref|| / ||out_ref||` of the noise prediction against the unmerged model;
- flicker: the same for the frame-to-frame differences of the prediction (`out[:, :, f+1] - out[:, :, f]`),
  which per-frame merging that chooses other tokens in neighbouring frames would move most.

Random weights say little about how a video looks; they compare the settings on equal terms. The trained
video model's measure of the same settings is `tome-processors quality --denoiser video` (docs/quality.md).

Example:
    $ python -m tome_processors.bench.video_probe                # real width, 1 block, 17 frames at 240x416
    >>> rows = probe(quick=True, sigmas=(0.5,), settings={"exact": {}})
    >>> sorted(rows[0])
    ['change', 'flicker', 'setting', 'sigma']
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..apply import apply_tome, remove_tome
from .dit import build_transformer

__all__ = ["SETTINGS", "probe"]

#: The settings compared (`ToMeConfig` options over Wan's defaults, ratio 0.5).
SETTINGS: dict[str, dict[str, Any]] = {
    "per-frame r=0.5 (exact)": {},
    "st=2 r=0.5": {"st": 2},
    "st=2 1x1 r=0.5": {"st": 2, "sx": 1, "sy": 1},
    "st=2 r=0.7": {"st": 2, "ratio": 0.7},
    "per-frame r=0.5 mlp": {"merge_mlp": True},
    "st=2 r=0.5 mlp": {"st": 2, "merge_mlp": True},
    "st=2 1x1 r=0.5 mlp": {"st": 2, "sx": 1, "sy": 1, "merge_mlp": True},
}


def _clip(channels: int, frames: int, h: int, w: int, generator: torch.Generator) -> torch.Tensor:
    # A smooth scene wider than the frame, seen through a window that moves 2 latent pixels per frame.
    scene = torch.randn(1, channels, h, w + 2 * frames, generator=generator)
    scene = torch.nn.functional.avg_pool2d(scene, 5, 1, 2)
    clip = torch.stack([scene[..., 2 * f : 2 * f + w] for f in range(frames)], dim=2)
    return clip / clip.std()


def probe(
    quick: bool = False,
    layers: int = 1,
    frames: int = 5,
    h: int = 30,
    w: int = 52,
    sigmas: tuple[float, ...] = (0.3, 0.7),
    settings: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per noise level and setting: `{"sigma", "setting", "change", "flicker"}` (the last two in percent).

    `frames`, `h`, `w`: the latent clip (default 5 x 30 x 52: 17 frames at 240x416 pixels).
    """
    model = build_transformer("wan", quick=quick, layers=layers)
    generator = torch.Generator().manual_seed(1)
    clip = _clip(model.config.in_channels, frames, h, w, generator)
    text = torch.randn(1, 16 if quick else 512, model.config.text_dim, generator=generator)
    rows = []
    for sigma in sigmas:
        noise = torch.randn(clip.shape, generator=torch.Generator().manual_seed(2))
        inputs = {
            "hidden_states": (1 - sigma) * clip + sigma * noise,
            "timestep": torch.tensor([int(1000 * sigma)]),
            "encoder_hidden_states": text,
        }
        with torch.inference_mode():
            reference = model(**inputs).sample
        steps = reference.diff(dim=2)
        for name, options in (settings or SETTINGS).items():
            apply_tome(model, **options)
            try:
                with torch.inference_mode():
                    out = model(**inputs).sample
            finally:
                remove_tome(model)
            change = float((out - reference).norm() / reference.norm())
            flicker = float((out.diff(dim=2) - steps).norm() / steps.norm())
            rows.append({"sigma": sigma, "setting": name, "change": 100 * change, "flicker": 100 * flicker})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the probe's table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny Wan instead of the real width")
    args = parser.parse_args(argv)
    print("| sigma | setting | change % | flicker % |\n|---|---|---|---|")
    for row in probe(quick=args.quick, layers=args.layers):
        print(f"| {row['sigma']} | {row['setting']} | {row['change']:.2f} | {row['flicker']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
