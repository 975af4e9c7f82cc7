"""The presets measured on the shipped trained denoisers: what `tome-processors quality --presets` prints.

Each family's presets (`ToMeConfig.from_preset`) run on the trained model of its shape
(`quality.bench_denoiser`): the UNet denoiser for UNets and Stable Video Diffusion, the PixArt-shaped DiT
for PixArt and SD3, the FLUX-shaped joint-attention model for FLUX.1, FLUX.2, Chroma, Qwen-Image and
Z-Image, the Wan-shaped video model for the video transformers. Two measures per preset, both against
the unmerged model:

- one forward at fixed noise levels (`quality.probe_quality`): the change of the noise prediction,
  the measure the presets' quality bounds are stated in ("balanced" at most ToMe at 0.5, "fast" at most twice;
  on the video model "balanced" also flickers no more than ToMe at 0.5 frame by frame);
- whole 20-step DDIM runs (`sampling.SamplingProbe`): the change of the final images, where reuse
  across steps (`recompute_every`) and errors carried from step to step show.

Example:
    >>> rows = preset_quality(["pixart"])  # doctest: +SKIP
    >>> rows[0]["preset"], rows[0]["within_target"]  # doctest: +SKIP
    ('ToMe r=0.5', True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..apply import apply_tome, remove_tome
from ..config import PRESETS, ToMeConfig
from ..families import FAMILIES
from .methods import config_changes
from .quality import bench_denoiser, probe_quality
from .sampling import SamplingProbe

#: The reference every bound is stated against: ToMe (tomesd's algorithm) at ratio 0.5.
REFERENCE = ToMeConfig(ratio=0.5)
#: How many times the reference's noise-prediction change each preset may cause.
TARGET_FACTOR = {"exact": None, "balanced": 1.0, "fast": 2.0}


def _settings(config: ToMeConfig) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config_changes(config).items()) or "tomesd's defaults"


#: The families whose presets are measured: every family (each has a trained model of its shape).
MEASURED_FAMILIES = tuple(FAMILIES)


def preset_quality(families: Sequence[str] = MEASURED_FAMILIES, steps: int = 20) -> list[dict[str, Any]]:
    """One row per family and preset (and the reference), with both measures and the check against its bound.

    Example:
        >>> [row["preset"] for row in preset_quality(["unet"])]  # doctest: +SKIP
        ['ToMe r=0.5', 'exact', 'balanced', 'fast']
    """
    unknown = [f for f in families if f not in MEASURED_FAMILIES]
    if unknown:
        raise ValueError(f"Expected families among {sorted(MEASURED_FAMILIES)}, but got {list(families)}.")
    samplers: dict[str, SamplingProbe] = {}
    rows = []
    for family in families:
        denoiser = bench_denoiser(family)
        sampler = samplers.setdefault(denoiser, SamplingProbe.default(denoiser, steps=steps, per_image=2))
        configs = {"ToMe r=0.5": REFERENCE, **{name: ToMeConfig.from_preset(name, family) for name in PRESETS}}
        reference: dict[str, float] = {}
        for name, config in configs.items():
            forward = probe_quality(config, denoiser)
            run = sampler.measure(lambda model, config=config: apply_tome(model, config), remove_tome)
            change, flicker = forward["eps_rel_change"], forward.get("flicker")
            reference = reference or forward
            factor = TARGET_FACTOR.get(name)
            within = None if factor is None else change <= factor * reference["eps_rel_change"]
            if within and name == "balanced" and flicker is not None:
                within = flicker <= reference["flicker"]
            rows.append(
                {
                    "family": family,
                    "denoiser": denoiser,
                    "preset": name,
                    "settings": _settings(config),
                    "eps_change": change,
                    "flicker": flicker,
                    "psnr_drop": forward["psnr_drop"],
                    "image_change": run["image_change"],
                    "image_psnr_drop": run["psnr_drop"],
                    "target": None if factor is None else factor * reference["eps_rel_change"],
                    "within_target": within,
                }
            )
    return rows


def preset_table(rows: list[dict[str, Any]]) -> str:
    """`preset_quality`'s rows as a markdown table (changes in percent)."""
    lines = [
        "| family | trained model | preset | settings | eps change % | target % | flicker % | PSNR drop dB "
        "| 20-step image change % | 20-step PSNR drop dB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        target = (
            "-"
            if row["target"] is None
            else f"<= {100 * row['target']:.2f}" + ("" if row["within_target"] else " (missed)")
        )
        flicker = "-" if row.get("flicker") is None else f"{100 * row['flicker']:.2f}"
        lines.append(
            f"| {row['family']} | {row['denoiser']} | {row['preset']} | {row['settings']} | "
            f"{100 * row['eps_change']:.2f} | {target} | {flicker} | {row['psnr_drop']:.3f} | "
            f"{100 * row['image_change']:.2f} | {row['image_psnr_drop']:.3f} |"
        )
    return "\n".join(lines)
