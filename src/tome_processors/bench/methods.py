"""The methods `tome-processors bench` compares: the baseline, this library, tomesd, and modes beyond tomesd.

Each builder returns `Method`s (see `engine.py`) that another tool can reuse, e.g. to add a quality
column computed on a trained model with the very same configurations. `pick_methods` is the bench's
choice of rows for a model.

The `overhead` of each method does, on the block inputs recorded in the reference forward, the tensor
work the method adds to one forward, and nothing else:

- this library (`mode="merge"`): the library's own per-block path, replayed: one `ModelState` per
  model, `begin` once per forward with the recorded grid and timestep, and per block a `BlockState`
  given the recorded block input, whose `merge_for(config)` draws the destinations, matches and keeps
  the merge exactly as in a forward (so `share_level` matches once per level); then one merge and one
  unmerge per merged module (self-attention by default);
- this library (`mode="downsample_kv"`): per pooled block (the library's `BlockState.grid` and
  `applies`), the K/V pooling (`pool_tokens`);
- tomesd: per merged block, `tomesd.merge.bipartite_soft_matching_random2d` and its merge and unmerge.

Example:
    >>> methods = [baseline_method(), *ours_methods([0.5], auto_downsample=1)]
    >>> [m.name for m in methods]
    ['baseline', 'ours r=0.5']
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..apply import apply_tome, remove_tome
from ..config import PRESETS, ToMeConfig
from ..context import BlockState, ModelState
from ..families import Family, max_downsample_for_levels
from ..merge import pool_tokens
from .engine import Apply, BlockInput, Method, Recording
from .meta import package_version

__all__ = [
    "MODES",
    "DEFAULT_MODES",
    "DEFAULT_PRESETS",
    "DEFAULT_RATIOS",
    "baseline_method",
    "mode_methods",
    "ours_method",
    "ours_methods",
    "pick_methods",
    "preset_methods",
    "tomesd_available",
    "tomesd_methods",
]


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """A named mode beyond tomesd: a family label, `ToMeConfig` options, and whether it sweeps the ratios.

    `levels` > 1 also acts on that many attention levels from the top (`max_downsample` set from the
    model's first attention level: 2 on SD1.5, 4 on SDXL).
    """

    family: str
    options: dict[str, Any]
    per_ratio: bool
    help: str
    levels: int = 1


#: `--modes` choices. Modes that act across denoising steps (`recompute_every`, `ratio_start`) are left
#: out: one UNet forward at a fixed timestep cannot show them; `--pipeline` generations can.
MODES: dict[str, ModeSpec] = {
    "kv-avg": ModeSpec(
        "ours kv-avg", {"mode": "downsample_kv", "kv_pool": "avg", "kv_factor": 2}, False, "ToDo: pool K/V 2x2 (mean)"
    ),
    "kv-nearest": ModeSpec(
        "ours kv-nearest",
        {"mode": "downsample_kv", "kv_pool": "nearest", "kv_factor": 2},
        False,
        "ToDo: pool K/V 2x2 (top-left token)",
    ),
    "kv-avg-2lv": ModeSpec(
        "ours kv-avg 2 levels",
        {"mode": "downsample_kv", "kv_pool": "avg", "kv_factor": 2},
        False,
        "ToDo: pool K/V 2x2 (mean) at the first two attention levels",
        levels=2,
    ),
    "kv4-avg": ModeSpec(
        "ours kv4-avg", {"mode": "downsample_kv", "kv_pool": "avg", "kv_factor": 4}, False, "ToDo: pool K/V 4x4 (mean)"
    ),
    "kv4-avg-2lv": ModeSpec(
        "ours kv4-avg 2 levels",
        {"mode": "downsample_kv", "kv_pool": "avg", "kv_factor": 4},
        False,
        "ToDo: pool K/V 4x4 (mean) at the first two attention levels",
        levels=2,
    ),
    "bf16": ModeSpec("ours bf16-sim", {"similarity_dtype": "bfloat16"}, True, "merge, similarity matrix in bfloat16"),
    "share": ModeSpec("ours share-level", {"share_level": True}, True, "merge, one matching per level and forward"),
    # Video families only (`Family.video`): windows across frames (`ToMeConfig.st`).
    "temporal": ModeSpec("ours st=2", {"st": 2}, True, "video: 2x2x2 windows across two frames, clip-wide matching"),
    "temporal-only": ModeSpec(
        "ours st=2 1x1", {"st": 2, "sx": 1, "sy": 1}, True, "video: windows of one place in two frames"
    ),
    "temporal-mlp": ModeSpec(
        "ours st=2 mlp", {"st": 2, "merge_mlp": True}, True, "video: st=2 with the feed-forward merged too"
    ),
    "window": ModeSpec("ours window", {"matching": "window"}, True, "merge, each source within its own window"),
    "window-share": ModeSpec(
        "ours window+share",
        {"matching": "window", "share_level": True},
        True,
        "window matching, one matching per level and forward",
    ),
    "mlp-share": ModeSpec(
        "ours mlp+share",
        {"merge_mlp": True, "share_level": True},
        True,
        "merge the feed-forward too, one matching per level and forward",
    ),
    "temporal-window": ModeSpec(
        "ours st=2 window", {"st": 2, "matching": "window"}, True, "video: 2x2x2 windows, window matching"
    ),
    "bf16-share": ModeSpec(
        "ours bf16+share",
        {"similarity_dtype": "bfloat16", "share_level": True},
        True,
        "both of the above",
    ),
}
#: A default run measures the presets (and tomesd at 0.5) only; `--full` adds `FULL_RATIOS` and every mode.
DEFAULT_MODES: tuple[str, ...] = ()
DEFAULT_RATIOS: tuple[float, ...] = ()
DEFAULT_PRESETS: tuple[str, ...] = PRESETS
FULL_RATIOS = (0.3, 0.5, 0.7)
#: tomesd's ratio when no `--ratios` are given: its default, what the "exact" preset runs on UNets.
TOMESD_DEFAULT_RATIO = 0.5


def _nothing(unet: torch.nn.Module) -> None:
    return None


def baseline_method() -> Method:
    """The model as it is (the CLI sets SDPA processors, `AttnProcessor2_0`, on it first)."""
    return Method("baseline", "baseline", None, _nothing, _nothing, settings={"processor": "AttnProcessor2_0"})


def _ours_overhead(config: ToMeConfig, auto_downsample: int) -> Callable[[Recording], Callable[[], Any]]:
    merges_per_block = int(config.merge_attn) + int(config.merge_crossattn) + int(config.merge_mlp)

    def build(recording: Recording) -> Callable[[], Any]:
        state = ModelState(config=config, auto_downsample=auto_downsample, needs_row_token=recording.needs_row_token)
        targets = [(BlockState(state, block.index), block) for block in recording.blocks if block.h]

        def run() -> None:
            with torch.inference_mode():
                grid = recording.latent_hw  # a video's: (frames, h, w)
                state.begin(grid[-2:], recording.timestep, None, frames=grid[0] if len(grid) == 3 else 1)
                for block, recorded in targets:
                    block.reset()
                    if config.mode == "downsample_kv":
                        grid = block.grid(recorded.hidden.shape[1])
                        if grid is not None and block.applies(config, grid):
                            factor = config.kv_factor_at(grid.downsample)
                            pool_tokens(recorded.hidden, grid.h, grid.w, factor, config.kv_pool)
                        continue
                    # The metric is the raw block input; the processor merges the normalised hidden
                    # states, a contiguous tensor (the recorded input may be a channels-first view).
                    block.metric = recorded.tokens
                    merge = block.merge_for(config)
                    block.reset()
                    if merge is not None:
                        for _ in range(merges_per_block):
                            merge.unmerge(merge.merge(recorded.hidden))

        return run

    return build


def config_changes(config: ToMeConfig) -> dict[str, Any]:
    """The fields of `config` that differ from `ToMeConfig()`'s (tomesd's defaults).

    Example:
        >>> config_changes(ToMeConfig(ratio=0.3, share_level=True))
        {'ratio': 0.3, 'share_level': True}
    """
    default = ToMeConfig()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(default, f.name)
    }


def ours_method(config: ToMeConfig, family: str, auto_downsample: int, name: str | None = None) -> Method:
    """This library with `config`, applied with `apply_tome` (wrapping the current processors).

    Example:
        >>> ours_method(ToMeConfig(ratio=0.3), "ours", auto_downsample=1).name
        'ours r=0.3'
    """
    ratio = config.ratio if config.mode == "merge" else None
    label = name or (f"{family} r={config.ratio:g}" if ratio is not None else family)

    def apply(unet: torch.nn.Module) -> None:
        apply_tome(unet, config)

    return Method(
        label, family, ratio, apply, remove_tome, _ours_overhead(config, auto_downsample), config_changes(config)
    )


def ours_methods(ratios: Sequence[float], auto_downsample: int, **options: Any) -> list[Method]:
    """This library at each ratio with the default (tomesd-faithful) options plus `options`."""
    return [ours_method(ToMeConfig(ratio=float(r), **options), "ours", auto_downsample) for r in ratios]


def preset_methods(presets: Sequence[str], model: torch.nn.Module | Family | str, auto_downsample: int) -> list[Method]:
    """One row per preset, with the settings for `model` (or a family or its name): `ToMeConfig.from_preset`.

    Example:
        >>> [m.name for m in preset_methods(["exact", "fast"], "pixart", auto_downsample=1)]
        ['ours exact r=0.4', 'ours fast r=0.7']
    """
    target = model.name if isinstance(model, Family) else model
    return [
        ours_method(ToMeConfig.from_preset(preset, target), f"ours {preset}", auto_downsample) for preset in presets
    ]


def mode_methods(modes: Sequence[str], ratios: Sequence[float], auto_downsample: int) -> list[Method]:
    """Rows for the named modes (`MODES`): one per ratio for merge variants, one for K/V pooling.

    Example:
        >>> [m.name for m in mode_methods(["kv-avg", "bf16"], [0.5], auto_downsample=1)]
        ['ours kv-avg', 'ours bf16-sim r=0.5']
    """
    methods = []
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"Expected modes among {sorted(MODES)}, but got {mode!r}.")
        spec = MODES[mode]
        options = dict(spec.options)
        if spec.levels > 1:
            options["max_downsample"] = max_downsample_for_levels(auto_downsample, spec.levels)
        for ratio in ratios if spec.per_ratio else [0.5]:
            config = ToMeConfig(ratio=float(ratio), **options)
            methods.append(ours_method(config, spec.family, auto_downsample))
    return methods


def tomesd_available() -> bool:
    """Whether tomesd can be imported."""
    return importlib.util.find_spec("tomesd") is not None


def _tomesd_overhead(ratio: float, max_downsample: int) -> Callable[[Recording], Callable[[], Any]]:
    from tomesd.merge import bipartite_soft_matching_random2d

    def build(recording: Recording) -> Callable[[], Any]:
        blocks: Sequence[BlockInput] = recording.blocks
        merged = [b for b in blocks if b.h and b.downsample <= max_downsample]
        targets = [(b, int(b.tokens.shape[1] * ratio), b.hidden) for b in merged]
        device = blocks[0].tokens.device if blocks else torch.device("cpu")
        generator = torch.Generator(device=device).manual_seed(0)

        def run() -> None:
            with torch.inference_mode():
                for block, r, hidden in targets:
                    tokens = block.tokens
                    no_rand = tokens.shape[0] % 2 == 1
                    merge, unmerge = bipartite_soft_matching_random2d(
                        tokens, block.w, block.h, 2, 2, r, no_rand=no_rand, generator=generator
                    )
                    unmerge(merge(hidden))

        return run

    return build


def tomesd_patch(ratio: float, max_downsample: int = 1) -> tuple[Apply, Apply]:
    """tomesd's own `apply_patch` at `ratio` and its `remove_patch`: the comparison, and the tests' oracle.

    tomesd draws its random destinations from a generator forked from the global RNG at the first forward,
    so applying seeds the global RNG first: every application of the patch draws the same destinations.

    Example:
        >>> apply, remove = tomesd_patch(0.5)  # doctest: +SKIP
    """
    import tomesd

    def apply(unet: torch.nn.Module) -> None:
        torch.manual_seed(0)
        tomesd.apply_patch(unet, ratio=ratio, max_downsample=max_downsample)

    return apply, tomesd.remove_patch


def tomesd_methods(ratios: Sequence[float], max_downsample: int) -> list[Method]:
    """tomesd 0.1.x at each ratio (its defaults, except `max_downsample`, set to the model's first attention level).

    Example:
        >>> [m.name for m in tomesd_methods([0.5], max_downsample=1)]  # doctest: +SKIP
        ['tomesd r=0.5']
    """
    methods = []
    for ratio in ratios:
        apply, remove = tomesd_patch(float(ratio), max_downsample)
        settings = {"ratio": float(ratio), "max_downsample": max_downsample, "version": package_version("tomesd")}
        overhead = _tomesd_overhead(float(ratio), max_downsample)
        methods.append(Method(f"tomesd r={ratio:g}", "tomesd", float(ratio), apply, remove, overhead, settings))
    return methods


def pick_methods(
    model: torch.nn.Module,
    family: Family | None,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    modes: Sequence[str] = DEFAULT_MODES,
    with_tomesd: bool = True,
    presets: Sequence[str] = DEFAULT_PRESETS,
) -> tuple[list[Method], list[str]]:
    """The bench's rows: the baseline, ours at each ratio, the presets, tomesd (UNets only), the modes.

    tomesd runs at `ratios`, or at its default 0.5 when none are given.

    `max_downsample="auto"` and tomesd's `max_downsample` both come from the family's
    `auto_downsample(model)` (the first level with attention). Modes that the family cannot run (K/V
    pooling on joint attention) are left out.

    Returns:
        `(methods, notes)`: the notes say what was left out and why.

    Example:
        >>> from tome_processors.bench.unet import build_unet
        >>> from tome_processors.families import find_family
        >>> unet = build_unet("tiny")
        >>> methods, notes = pick_methods(unet, find_family(unet), [0.5], ["kv-avg"], False, ["fast"])
        >>> [m.name for m in methods], notes
        (['baseline', 'ours r=0.5', 'ours fast', 'ours kv-avg'], [])
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"Expected modes among {sorted(MODES)}, but got {list(modes)}.")
    auto_downsample = family.auto_downsample(model) if family is not None else 1
    notes: list[str] = []
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"Expected presets among {list(PRESETS)}, but got {list(presets)}.")
    methods = [baseline_method(), *ours_methods(ratios, auto_downsample)]
    methods += preset_methods(presets, model if family is not None else "unet", auto_downsample)
    if with_tomesd:
        if family is not None and family.name != "unet":
            pass  # tomesd patches UNet blocks only
        elif tomesd_available():
            methods += tomesd_methods(ratios or [TOMESD_DEFAULT_RATIO], max_downsample=auto_downsample)
        else:
            notes.append("tomesd is not installed (pip install tomesd), so its rows are left out.")
    if family is None or not family.video:  # windows across frames need frames
        skipped = [m for m in modes if MODES[m].options.get("st", 1) != 1]
        modes = [m for m in modes if m not in skipped]
        if skipped:
            notes.append(f"modes {skipped} need a video model and are left out.")
    if family is not None and family.merge_only:  # joint attention: no K/V pooling (docs/transformers.md)
        skipped = [m for m in modes if MODES[m].options.get("mode", "merge") != "merge"]
        modes = [m for m in modes if m not in skipped]
        if skipped:
            notes.append(f"modes {skipped} do not apply to {family.name} and are left out.")
    return methods + mode_methods(modes, ratios, auto_downsample), notes
