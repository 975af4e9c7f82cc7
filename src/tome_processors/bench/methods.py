"""The methods `tome-processors bench` compares: the baseline, this library, tomesd, and modes beyond tomesd.

Each builder returns `Method`s (see `benchmark.py`) that another tool can reuse, e.g. to add a quality
column computed on a trained model with the very same configurations.

The `overhead` of each method does, on the block inputs recorded in the reference forward, the tensor
work the method adds to one UNet forward, and nothing else:

- this library (`mode="merge"`): per merged block, the destination choice (`window_choice`), the matching
  (`bipartite_soft_matching_2d`), one merge and one unmerge per merged module (self-attention by default);
  with `share_level`, one matching per level;
- this library (`mode="downsample_kv"`): per pooled block, the K/V pooling (`pool_tokens`);
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

from .apply import apply_tome, remove_tome
from .benchmark import BlockInput, Method
from .config import ToMeConfig
from .context import step_key_from_timestep
from .merge import bipartite_soft_matching_2d, pool_tokens, window_choice

__all__ = [
    "MODES",
    "DEFAULT_MODES",
    "baseline_method",
    "mode_methods",
    "ours_method",
    "ours_methods",
    "tomesd_available",
    "tomesd_methods",
]

#: The timestep `UNetInputs` uses; the overhead replays the merge at this step.
BENCH_TIMESTEP = 500


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
    "bf16-share": ModeSpec(
        "ours bf16+share",
        {"similarity_dtype": "bfloat16", "share_level": True},
        True,
        "both of the above",
    ),
}
DEFAULT_MODES = ("kv-avg", "kv-avg-2lv", "kv-nearest", "kv4-avg", "bf16")


def _nothing(unet: torch.nn.Module) -> None:
    return None


def baseline_method() -> Method:
    """The model as it is (the CLI sets SDPA processors, `AttnProcessor2_0`, on it first)."""
    return Method("baseline", "baseline", None, _nothing, _nothing, settings={"processor": "AttnProcessor2_0"})


def _ours_overhead(config: ToMeConfig, auto_downsample: int) -> Callable[[Sequence[BlockInput]], Callable[[], Any]]:
    merges_per_block = int(config.merge_attn) + int(config.merge_crossattn) + int(config.merge_mlp)
    similarity_dtype = None if config.similarity_dtype is None else getattr(torch, config.similarity_dtype)

    max_downsample = auto_downsample if config.max_downsample == "auto" else int(config.max_downsample)

    def build(blocks: Sequence[BlockInput]) -> Callable[[], Any]:
        targets = []
        for index, block in enumerate(blocks):
            if block.h == 0:
                continue
            level_ratio = config.level_ratio(block.downsample, max_downsample)
            r = int(block.tokens.shape[1] * config.ratio_at(level_ratio, BENCH_TIMESTEP))
            if level_ratio > 0 and (r > 0 or config.mode == "downsample_kv"):
                # The processor merges the normalised hidden states, a contiguous tensor; the recorded
                # block input may be a channels-first view, whose merge would add a copy.
                targets.append((index, block, r, _hidden(block)))

        def run() -> None:
            with torch.inference_mode():
                if config.mode == "downsample_kv":
                    for _, block, _, hidden in targets:
                        pool_tokens(hidden, block.h, block.w, config.kv_factor, config.kv_pool)
                    return
                shared: dict[int, Any] = {}
                step_key = step_key_from_timestep(BENCH_TIMESTEP, blocks[0].tokens.device)
                for index, block, r, hidden in targets:
                    merge = shared.get(block.downsample) if config.share_level else None
                    if merge is None:
                        tokens = block.tokens
                        choice = None
                        hsy, wsx = block.h // config.sy, block.w // config.sx
                        if config.use_rand and tokens.shape[0] % 2 == 0 and hsy > 0 and wsx > 0:
                            base = (config.seed * 104_729 + index * 7_919) & 0x7FFFFFFF
                            key = (step_key * 1_000_003 + base) & 0x7FFFFFFF
                            choice = window_choice(hsy, wsx, config.sx * config.sy, key)
                        merge = bipartite_soft_matching_2d(
                            tokens, block.h, block.w, config.sx, config.sy, r, choice, similarity_dtype
                        )
                        shared[block.downsample] = merge
                    for _ in range(merges_per_block):
                        merge.unmerge(merge.merge(hidden))

        return run

    return build


def _hidden(block: BlockInput) -> torch.Tensor:
    return block.hidden if block.hidden is not None else block.tokens.contiguous()


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

    settings = {k: v for k, v in dataclasses.asdict(config).items() if v != getattr(ToMeConfig(), k)}
    return Method(label, family, ratio, apply, remove_tome, _ours_overhead(config, auto_downsample), settings)


def ours_methods(ratios: Sequence[float], auto_downsample: int, **options: Any) -> list[Method]:
    """This library at each ratio with the default (tomesd-faithful) options plus `options`."""
    return [ours_method(ToMeConfig(ratio=float(r), **options), "ours", auto_downsample) for r in ratios]


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
            options["max_downsample"] = auto_downsample * 2 ** (spec.levels - 1)
        for ratio in ratios if spec.per_ratio else [0.5]:
            config = ToMeConfig(ratio=float(ratio), **options)
            methods.append(ours_method(config, spec.family, auto_downsample))
    return methods


def tomesd_available() -> bool:
    """Whether tomesd can be imported."""
    return importlib.util.find_spec("tomesd") is not None


def _tomesd_overhead(ratio: float, max_downsample: int) -> Callable[[Sequence[BlockInput]], Callable[[], Any]]:
    from tomesd.merge import bipartite_soft_matching_random2d  # noqa: PLC0415

    def build(blocks: Sequence[BlockInput]) -> Callable[[], Any]:
        targets = [
            (b, int(b.tokens.shape[1] * ratio), _hidden(b)) for b in blocks if b.h and b.downsample <= max_downsample
        ]
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


def tomesd_methods(ratios: Sequence[float], max_downsample: int) -> list[Method]:
    """tomesd 0.1.x at each ratio (its defaults, except `max_downsample`, set to the model's first attention level).

    Example:
        >>> [m.name for m in tomesd_methods([0.5], max_downsample=1)]  # doctest: +SKIP
        ['tomesd r=0.5']
    """
    import tomesd  # noqa: PLC0415

    methods = []
    for ratio in ratios:

        def apply(unet: torch.nn.Module, ratio: float = float(ratio)) -> None:
            tomesd.apply_patch(unet, ratio=ratio, max_downsample=max_downsample)

        settings = {"ratio": float(ratio), "max_downsample": max_downsample, "version": _version("tomesd")}
        methods.append(
            Method(
                f"tomesd r={ratio:g}",
                "tomesd",
                float(ratio),
                apply,
                tomesd.remove_patch,
                _tomesd_overhead(float(ratio), max_downsample),
                settings,
            )
        )
    return methods


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(package)
    except PackageNotFoundError:
        return None
