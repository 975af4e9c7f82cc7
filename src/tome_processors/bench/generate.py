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

from .engine import Method
from .report import save_grid

__all__ = ["generate_grid", "generate_image"]


def generate_image(
    pipe: Any,
    prompt: str,
    seed: int,
    steps: int,
    guidance_scale: float,
    height: int | None = None,
    width: int | None = None,
    **call_kwargs: Any,
) -> tuple[Any, float]:
    """One image of `prompt` from `seed` (a generator on the pipeline's device; on MPS, the CPU's).

    `height` / `width` None use the pipeline's defaults. Timed end to end (text encoder, every denoising
    step, VAE decode), with a device synchronise before and after on CUDA.

    Returns:
        `(PIL image, seconds)`.
    """
    device = getattr(pipe, "device", torch.device("cpu"))
    generator = torch.Generator(device="cpu" if device.type == "mps" else device).manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        num_inference_steps=steps, guidance_scale=guidance_scale, generator=generator, output_type="pil"
    )
    if height is not None:
        kwargs["height"] = height
    if width is not None:
        kwargs["width"] = width
    kwargs.update(call_kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        image = pipe(prompt, **kwargs).images[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return image, time.perf_counter() - start


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
    generate_image(pipe, prompt, seed, min(steps, 2), guidance_scale, resolution, resolution)  # warm-up
    images, labels, results = [], [], []
    for method in methods:
        method.apply(pipe.unet)
        try:
            image, seconds = generate_image(pipe, prompt, seed, steps, guidance_scale, resolution, resolution)
        finally:
            method.remove(pipe.unet)
        images.append(image)
        ratio = "" if method.ratio is None else f"ratio {method.ratio:g}, "
        labels.append(f"{method.family}\n{ratio}{seconds:.2f} s/image")
        results.append((method.name, seconds))
    save_grid(images, labels, path)
    return results
