"""`tome-processors bench --pipeline`: full generations of one prompt per method, saved as a labelled grid.

Every method generates the same prompt from the same seed, timed end to end (text encoder, all denoising
steps, VAE decode). One untimed short generation comes first, so the first method pays no warm-up.

Example:
    >>> results = generate_grid(pipe, methods, "a red fox in the snow", "grid.png", steps=20)  # doctest: +SKIP
    >>> results[0]  # doctest: +SKIP
    ('baseline', 41.2)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .bench_report import save_grid
from .benchmark import Method

__all__ = ["generate_grid"]


def _generate(pipe: Any, prompt: str, steps: int, guidance_scale: float, resolution: int, seed: int) -> Any:
    device = pipe.device
    generator = torch.Generator(device="cpu" if device.type == "mps" else device).manual_seed(seed)
    with torch.inference_mode():
        return pipe(
            prompt,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            height=resolution,
            width=resolution,
            generator=generator,
        ).images[0]


def generate_grid(
    pipe: Any,
    methods: Sequence[Method],
    prompt: str,
    path: str | Path,
    steps: int = 20,
    guidance_scale: float = 7.5,
    resolution: int = 512,
    seed: int = 0,
) -> list[tuple[str, float]]:
    """Generate `prompt` once per method on `pipe` (methods are applied to `pipe.unet`) and save a grid.

    Returns:
        `[(method name, seconds per image)]` in the order of `methods`.
    """
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    _generate(pipe, prompt, min(steps, 2), guidance_scale, resolution, seed)  # warm-up
    images, labels, results = [], [], []
    for method in methods:
        method.apply(pipe.unet)
        try:
            start = time.perf_counter()
            image = _generate(pipe, prompt, steps, guidance_scale, resolution, seed)
            if pipe.device.type == "cuda":
                torch.cuda.synchronize(pipe.device)
            seconds = time.perf_counter() - start
        finally:
            method.remove(pipe.unet)
        images.append(image)
        ratio = "" if method.ratio is None else f"ratio {method.ratio:g}, "
        labels.append(f"{method.family}\n{ratio}{seconds:.2f} s/image")
        results.append((method.name, seconds))
    save_grid(images, labels, path)
    return results
