"""`explain_tome`: what ToMe would do at each merge site of a model for one image size, before generating."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .apply import target_models
from .config import PRESETS, Preset, ToMeConfig
from .families import Family, family_of
from .hooks import context_of
from .pays import decide, group_of, predicted_speedup, site_shapes, site_tokens

#: A pipeline's attributes for the VAE's factor in space and in time, in the order they are read.
_PIPELINE_SPATIAL = ("vae_scale_factor_spatial", "vae_spatial_compression_ratio", "vae_scale_factor")
_PIPELINE_TEMPORAL = ("vae_scale_factor_temporal", "vae_temporal_compression_ratio")


@dataclass(frozen=True)
class SiteExplanation:
    """One merge site (the blocks of one level and width) of one model under one setting.

    Attributes:
        model: the model's class name.
        setting: the preset's name, or `"config"` for a given or applied configuration.
        level: the site's downsample level (1 at the model's token grid).
        width: the blocks' channels.
        blocks: how many blocks the site has.
        tokens: image tokens per sample at the site.
        batch: the batch the forward would have.
        selected: whether the setting merges at this level at all (`max_downsample`, `level_ratios`).
        merges: whether it merges there for this size and device type.
        kv_factor: the K/V pooling window side used there (`mode="downsample_kv"`), else None.
        why: why it merges or not.
        predicted_speedup: the whole-forward speed-up the measured figures give at this site's size, 1.0 where
            nothing is merged, None where no figure is measured for the device type and kind.
        measured: which figures that comes from.
    """

    model: str
    setting: str
    level: int
    width: int
    blocks: int
    tokens: int
    batch: int
    selected: bool
    merges: bool
    kv_factor: int | None
    why: str
    predicted_speedup: float | None
    measured: str


def explain_tome(
    model_or_pipeline: Any,
    height: int,
    width: int,
    batch: int = 1,
    device_type: str | None = None,
    *,
    num_frames: int | None = None,
    config: ToMeConfig | None = None,
    preset: Preset | None = None,
    vae_scale_factor: int | None = None,
    print_table: bool = True,
) -> list[SiteExplanation]:
    """Print and return, per merge site, what ToMe does at `height x width` pixels: tokens, whether it merges and
    why, and the speed-up the measured figures predict.

    The token grid is the image over the VAE's factor (a pipeline's `vae_scale_factor`; for a bare model
    `vae_scale_factor`, else the factor of the family's released VAE: 8, 16 on HunyuanVideo 1.5, 32 on LTX), then
    over the model's patch (`config.patch_size`; 2 on the families whose pipelines pack latents: FLUX, Chroma,
    Qwen-Image, Z-Image).

    Nothing runs and nothing changes: the verdicts come from shapes and the device type alone, as with
    `pays_only=True` (every preset) at the first forward of that size. The setting explained is `config`, else
    `preset`, else the configuration of the ToMe applied to the model, else each preset in turn. A setting with
    `pays_only=False` (an explicit `apply_tome(pipe, ratio=0.5)`) merges at every site it selects.

    Args:
        model_or_pipeline: a pipeline (its denoisers are explained) or a model of a supported family.
        height / width: the image (or video frame) size in pixels.
        batch: the forward's batch (e.g. 2 with classifier-free guidance); the verdicts are per sample.
        device_type: `"cuda"`, `"cpu"`, ...; default the model's parameters' device type.
        num_frames: a video model's pixel frames (default 1): the clip one forward generates (Helios: one chunk's);
            latent frames the family's pipelines add to the clip's (Wan-Animate's reference image) are counted, and
            a model that patches several latent frames into a token (`config.patch_size_t`: CogVideoX 1.5's 2) gets
            that many fewer, its pipelines padding the latent to a multiple of them.
        config / preset: the setting to explain (at most one).
        vae_scale_factor: pixels per latent pixel; default the pipeline's, or for a bare model the family's.
        print_table: print the rows as a table.

    Example:
        >>> from tome_processors import explain_tome
        >>> rows = explain_tome(pipe, height=2048, width=2048, device_type="cuda", preset="fast")  # doctest: +SKIP
        >>> [(row.level, row.tokens, row.merges, row.kv_factor) for row in rows]  # doctest: +SKIP
        [(1, 65536, True, 4), (2, 16384, True, 2), (4, 4096, False, None), (8, 1024, False, None)]
    """
    for name, value in (("height", height), ("width", width), ("batch", batch)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"Expected {name} to be a positive int, but got {value!r}.")
    if num_frames is not None and not (isinstance(num_frames, int) and num_frames > 0):
        raise ValueError(f"Expected num_frames to be a positive int or None, but got {num_frames!r}.")
    if config is not None and preset is not None:
        raise ValueError(f"Expected a config or a preset, not both, but got config and preset={preset!r}.")
    if config is not None and not isinstance(config, ToMeConfig):
        raise TypeError(f"Expected config to be a ToMeConfig or None, but got {type(config).__name__}.")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"Expected preset to be one of {list(PRESETS)} or None, but got {preset!r}.")
    if device_type is not None and not isinstance(device_type, str):
        raise TypeError(f"Expected device_type to be a str such as 'cuda' or None, but got {device_type!r}.")
    if vae_scale_factor is not None and not (
        isinstance(vae_scale_factor, int) and not isinstance(vae_scale_factor, bool) and vae_scale_factor > 0
    ):
        raise ValueError(f"Expected vae_scale_factor to be a positive int or None, but got {vae_scale_factor!r}.")
    models = target_models(model_or_pipeline)
    if not models:
        raise ValueError(f"Expected a pipeline or a supported model, but got {type(model_or_pipeline).__name__}.")
    pipe = None if isinstance(model_or_pipeline, torch.nn.Module) else model_or_pipeline
    spatial = vae_scale_factor or _pipeline_factor(pipe, _PIPELINE_SPATIAL)
    temporal = _pipeline_factor(pipe, _PIPELINE_TEMPORAL)
    scale = _Scale(spatial, temporal)
    rows: list[SiteExplanation] = []
    for model in models:
        rows += _explain_model(model, height, width, batch, device_type, num_frames, config, preset, scale)
    if print_table:
        print(explanation_table(rows))
    return rows


@dataclass(frozen=True)
class _Scale:
    """The VAE's factors a pipeline (or the caller) gives: pixels per latent pixel, pixel frames per latent
    frame; None where the family's usual one applies."""

    spatial: int | None
    temporal: int | None


def _pipeline_factor(pipe: Any, names: tuple[str, ...]) -> int | None:
    """The first of `names` that `pipe` holds as a positive int (its VAE's factor), else None."""
    for name in names:
        value = getattr(pipe, name, None) if pipe is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def pixels_per_token(model: torch.nn.Module, family: Family, vae_factor: int | None = None) -> int:
    """Pixels per token side of `model`: the VAE's factor (`vae_factor`, else the family's
    `Family.vae_scale_factor`) times the latent pixels per token (`Family.pipeline_patch` where the pipeline packs
    latents, else the model's `config.patch_size`).

    Example:
        >>> from types import SimpleNamespace
        >>> from tome_processors.families import FAMILIES
        >>> pixart = SimpleNamespace(config=SimpleNamespace(patch_size=2))
        >>> unet = SimpleNamespace(config=SimpleNamespace())
        >>> pixels_per_token(pixart, FAMILIES["pixart"]()), pixels_per_token(unet, FAMILIES["unet"](), vae_factor=2)
        (16, 2)
    """
    patch: Any = family.pipeline_patch or getattr(model.config, "patch_size", 1)
    if isinstance(patch, (tuple, list)):  # Wan's (frames, height, width)
        patch = patch[-1]
    return (vae_factor or family.vae_scale_factor) * int(patch or 1)


def _settings(model: torch.nn.Module, config: ToMeConfig | None, preset: str | None) -> list[tuple[str, ToMeConfig]]:
    if config is not None:
        return [("config", config)]
    if preset is not None:
        return [(preset, ToMeConfig.from_preset(preset, model))]
    context = context_of(model)
    if context is not None:
        return [("config", context.model_state.config)]
    return [(name, ToMeConfig.from_preset(name, model)) for name in PRESETS]


def _explain_model(
    model: torch.nn.Module,
    height: int,
    width: int,
    batch: int,
    device_type: str | None,
    num_frames: int | None,
    config: ToMeConfig | None,
    preset: str | None,
    scale: _Scale,
) -> list[SiteExplanation]:
    family = family_of(model)
    device_type = device_type or next((p.device.type for p in model.parameters()), "cpu")
    stride = pixels_per_token(model, family, scale.spatial)
    grid = (max(height // stride, 1), max(width // stride, 1))
    frames = 1
    if family.video:
        frames = family.latent_frames(num_frames or 1, scale.temporal)
        # Latent frames a token (CogVideoX 1.5's 2; its pipelines pad the latent to a multiple of them).
        patch_t = int(getattr(model.config, "patch_size_t", None) or 1)
        frames = -(-frames // patch_t)
    shapes = site_shapes(model, family, family.blocks(model))
    group = group_of(family.name)
    auto = family.auto_downsample(model)
    rows = []
    for name, setting in _settings(model, config, preset):
        max_downsample = auto if setting.max_downsample == "auto" else int(setting.max_downsample)
        _, verdicts = decide(setting.replace(pays_only=True), group, shapes, grid, frames, device_type, max_downsample)
        sites: dict[tuple[int, int], int] = {}
        for shape in shapes:
            sites[(shape.level, shape.width)] = sites.get((shape.level, shape.width), 0) + 1
        for (level, site_width), blocks in sorted(sites.items()):
            tokens = site_tokens(grid, level, frames)
            verdict = verdicts.get((level, site_width))
            kv = setting.mode == "downsample_kv"
            if verdict is None:
                merges, factor, speedup, measured = False, 0, 1.0, "-"
                why = "not selected (max_downsample / level_ratios)"
            elif not setting.pays_only:
                merges, factor = True, setting.kv_factor_at(level)
                pays = "pays" if verdict.factor else "would not pay"
                why = f"pays_only=False: merges wherever selected ({pays})"
                kind = _kind(setting, level, verdict.kind)
                speedup, measured = predicted_speedup(device_type, group, kind, verdict.value)
            else:
                merges, factor, why = verdict.factor > 0, verdict.factor, verdict.why
                speedup, measured = predicted_speedup(device_type, group, verdict.kind, verdict.value)
                if not merges:
                    measured = f"would be {speedup}x: {measured}" if speedup is not None else measured
                    speedup = 1.0
            rows.append(
                SiteExplanation(
                    model=type(model).__name__,
                    setting=name,
                    level=level,
                    width=site_width,
                    blocks=blocks,
                    tokens=tokens,
                    batch=batch,
                    selected=verdict is not None,
                    merges=merges,
                    kv_factor=factor if kv and merges else None,
                    why=why,
                    predicted_speedup=speedup,
                    measured=measured,
                )
            )
    return rows


def _kind(config: ToMeConfig, level: int, kind: str) -> str:
    # Forced merging pools with the config's own window (the rule may have narrowed it).
    if config.mode == "downsample_kv":
        return "kv4" if config.kv_factor_at(level) >= 4 else "kv2"
    return kind


def explanation_table(rows: list[SiteExplanation]) -> str:
    """`explain_tome`'s rows as a markdown table."""
    lines = [
        "| model | setting | level | width | blocks | tokens x batch | merges | why | predicted | measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        merges = ("yes" + (f" ({row.kv_factor}x{row.kv_factor} K/V)" if row.kv_factor else "")) if row.merges else "no"
        predicted = "-" if row.predicted_speedup is None else f"{row.predicted_speedup:.2f}x"
        lines.append(
            f"| {row.model} | {row.setting} | {row.level} | {row.width} | {row.blocks} | {row.tokens} x {row.batch} | "
            f"{merges} | {row.why} | {predicted} | {row.measured} |"
        )
    return "\n".join(lines)
