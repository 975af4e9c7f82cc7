"""`explain_tome`: what ToMe would do at each merge site of a model for one image size, before generating."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .apply import target_models
from .config import PRESETS, Preset, ToMeConfig
from .families import family_of
from .hooks import context_of
from .pays import decide, group_of, predicted_speedup, site_shapes, site_tokens

#: Pixels per token side where it is not 8 (a UNet's latent): the transformers' VAE (8 or 16) times their patch
#: or packing (2, or 1 on a 16x VAE), LTX-Video's and LTX-2's 32x VAE.
_PIXELS_PER_TOKEN = {"unet": 8, "svd": 8, "ltx": 32, "ltx2": 32}
#: Pixel frames per latent frame of the video families (the VAE's stride in time).
_FRAMES_PER_LATENT = {"wan": 4, "hunyuanvideo": 4, "hunyuanvideo15": 4, "ltx": 8, "ltx2": 8}


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
    print_table: bool = True,
) -> list[SiteExplanation]:
    """Print and return, per merge site, what ToMe does at `height x width` pixels: tokens, whether it merges and
    why, and the speed-up the measured figures predict.

    Nothing runs and nothing changes: the verdicts come from shapes and the device type alone, as with
    `pays_only=True` (every preset) at the first forward of that size. The setting explained is `config`, else
    `preset`, else the configuration of the ToMe applied to the model, else each preset in turn. A setting with
    `pays_only=False` (an explicit `apply_tome(pipe, ratio=0.5)`) merges at every site it selects.

    Args:
        model_or_pipeline: a pipeline (its denoisers are explained) or a model of a supported family.
        height / width: the image (or video frame) size in pixels.
        batch: the forward's batch (e.g. 2 with classifier-free guidance); the verdicts are per sample.
        device_type: `"cuda"`, `"cpu"`, ...; default the model's parameters' device type.
        num_frames: a video model's pixel frames (default 1).
        config / preset: the setting to explain (at most one).
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
    models = target_models(model_or_pipeline)
    if not models:
        raise ValueError(f"Expected a pipeline or a supported model, but got {type(model_or_pipeline).__name__}.")
    rows: list[SiteExplanation] = []
    for model in models:
        rows += _explain_model(model, height, width, batch, device_type, num_frames, config, preset)
    if print_table:
        print(explanation_table(rows))
    return rows


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
) -> list[SiteExplanation]:
    family = family_of(model)
    device_type = device_type or next((p.device.type for p in model.parameters()), "cpu")
    stride = _PIXELS_PER_TOKEN.get(family.name, 16)
    grid = (max(height // stride, 1), max(width // stride, 1))
    frames = 1
    if family.video:
        frames = 1 + (max(num_frames or 1, 1) - 1) // _FRAMES_PER_LATENT.get(family.name, 4)
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
