"""Where merging pays: a rule from shapes and the device type alone, with the measured figures it stands on.

A merge site is the blocks of one level of a model (a UNet level; a transformer's blocks, all at its patch
grid). Whether merging there makes a forward faster depends on how much of the site's work attention is, and
on what the merge itself costs beside it, for one sample:

- K/V pooling (`mode="downsample_kv"`) only shortens attention's keys and values and costs one pooling op, so it
  pays where attention is a large share of the block: from enough tokens per channel, `load = N / C` (N image
  tokens at the site, C the block's width; attention's work grows as `N^2 C`, the linears' as `N C^2`).
- Merging (`mode="merge"`) pays its matching and its gathers in every block, so the block's whole work must be
  large beside them: `work = N C (N + C)`. With `share_level` one matching serves the level's blocks, so the
  level's work (`depth x work`) counts too.

The thresholds (`PaysThresholds`, one per device type and model group) come from `tome-processors bench` runs
(each with its command and commit in `THRESHOLDS`' comments and docs/benchmarks.md). `PAYS_TABLE` is the table in
force; `pays_table()` swaps it (tests, a user with figures of their own). A config with `pays_only=True` (every
preset sets it) merges nothing at sites below a threshold and, for K/V pooling with `kv_factor >= 4`, pools 2x2
where 4x4 did not pay more than 2x2. The decision is made once per token grid and device type, in the model's
forward pre-hook, from shapes only (no tensor is read), and said once at INFO level through this module's logger.

Example:
    >>> from tome_processors.pays import judge
    >>> from tome_processors import ToMeConfig
    >>> balanced = ToMeConfig.from_preset("balanced", "unet")
    >>> judge(balanced, "unet", tokens=4096, width=640, depth=2, device_type="cuda").factor  # SDXL at 1024 px
    0
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import ToMeConfig

if TYPE_CHECKING:
    import torch

    from .families import BlockSite, Family

logger = logging.getLogger(__name__)

#: Families whose blocks sit on a UNet's levels; every other family is a transformer (all blocks at one grid).
UNET_FAMILIES = frozenset({"unet", "svd"})


def group_of(family_name: str) -> str:
    """`"unet"` for the UNet families (SD1.x, SD2.x, SDXL, AnimateDiff, SVD), else `"transformer"`.

    Example:
        >>> group_of("svd"), group_of("pixart")
        ('unet', 'transformer')
    """
    return "unet" if family_name in UNET_FAMILIES else "transformer"


@dataclass(frozen=True)
class PaysThresholds:
    """Below these, merging at a site makes the forward slower (or no faster) on one device type and model group.

    Attributes:
        kv_load: K/V pooling pays from this many tokens per channel (`N / C`) at the site.
        kv4_load: pooling 4x4 (`kv_factor >= 4`) pays more than 2x2 from this `N / C`; below it, 2x2 is pooled.
        block_work: merging with a matching per block pays from this work per block, `N C (N + C)`.
        shared_block_work: with `share_level`, the work per block it needs ...
        shared_level_work: ... and the work of the level's blocks together, `depth x N C (N + C)`.
        kv_work: K/V pooling also needs this work per block (a tiny model's forward is its ops' host cost).
    """

    kv_load: float
    kv4_load: float
    block_work: float
    shared_block_work: float
    shared_level_work: float
    kv_work: float = 0.0


#: Merges everywhere a config selects: what `pays_only=False` does, and a table for tests.
ALWAYS = PaysThresholds(0.0, 0.0, 0.0, 0.0, 0.0)

# Where each number comes from (median speed-ups of whole forwards, paired interleaved rounds):
# GPU: one NVIDIA H100, fp16, library at 772857c (`tome-processors bench --device cuda --arch sd15 --resolution
#   1024 --batch 2 ...` / `--resolution 2048 --batch 1`, `--arch sdxl --resolution 2048 --batch 1`, the `hires`
#   part of scripts/gpu_figures.sh), and one NVIDIA H200, bf16/fp16, library at d4b8084 (docs/benchmarks.md:
#   `--arch sd15 --resolution 512`, `--arch sdxl|pixart --resolution 1024`, batch 2; the `newimages`, `newvideo`,
#   `window` parts at 1024 px and the video clips).
# CPU: this machine class (2-core x86 VM, float32, one thread), library at a442b15: `tome-processors bench --arch
#   ARCH --quick --threads 1 --no-tomesd --no-trained-quality` for every arch, and the real-width runs named below.
THRESHOLDS: dict[tuple[str, str], PaysThresholds] = {
    ("cuda", "unet"): PaysThresholds(
        # K/V pooling 2x2: N/C 6.4 (SDXL 1024 b2, level 2) 0.98x; 12.8 (SD1.5 512 b2, level 1) 1.02x.
        kv_load=12.0,
        # 4x4 against 2x2: N/C 25.6 (SDXL 2048 b1) 1.00x against 1.04x (avg pooling); 51.2 (SD1.5 1024 b2)
        # 1.17x against 1.16x; 204.8 (SD1.5 2048 b1) 2.03x against 1.71x.
        kv4_load=50.0,
        # ToMe (`exact`): work 8.8e10 (SD1.5 1024 b2) 0.95x, 1.8e11 (SDXL 2048 b1) 0.95x, 1.4e12 (SD1.5 2048 b1)
        # 1.52x: the geometric mean of the last two.
        block_work=5e11,
        # No UNet preset shares a level; as a matching per block.
        shared_block_work=5e11,
        shared_level_work=0.0,
    ),
    ("cuda", "transformer"): PaysThresholds(
        # No transformer family pools keys and values (joint attention); the UNets' figures.
        kv_load=12.0,
        kv4_load=50.0,
        # `exact` (a matching per block): work 9.0e10 (FLUX.1, Chroma, Qwen-Image at 1024 px) 0.96-1.00x,
        # 1.25e11 (Z-Image) 1.01x, 2.6e11 (FLUX.2, LTX-2) 1.11x / 1.06x, PixArt 2.5e10 0.71x.
        block_work=1.2e11,
        # `balanced` / `fast` (share_level): PixArt 2.5e10 per block 0.96x / 0.94x (28 blocks); 9.0e10 per block:
        # Qwen-Image at 4 blocks (3.6e11 in all) 1.07x and 0.94x in two runs, Chroma and FLUX.1 at 8 blocks
        # (7.2e11) 1.15x / 1.17x; Qwen-Image at 8 blocks 1.22x per step. Level: the geometric mean of 3.6e11
        # and 7.2e11.
        shared_block_work=9e10,
        shared_level_work=5e11,
    ),
    ("cpu", "unet"): PaysThresholds(
        # K/V pooling: N/C 1 (tiny SDXL, --quick, level 2) 0.96x; 3.2 (SD1.5 256 px b2, real width) 1.03x, 4x4
        # 1.08x; 8 (tiny SD1.5, --quick) 1.05x and 1.13x in two runs, within their spread (0.80-1.18x); 12.8
        # (SD1.5 512 b2, docs/benchmarks.md at f0ce884) 1.20x.
        kv_load=3.0,
        # 4x4 pays at least as much as 2x2 wherever pooling pays: N/C 3.2 1.08x against 1.03x, 8 1.09x / 1.17x
        # against 1.05x / 1.13x, 12.8 1.23x against 1.20x, 51.2 (SD1.5 1024 b1, docs/options.md) 1.79x
        # against 1.54x.
        kv4_load=0.0,
        # ToMe: work 2.4e6 (tiny SD1.5, --quick) 0.89x / 0.95x; 4.4e8 (SD1.5 256 px b2) 1.04x; 5.8e9 (SD1.5
        # 512 b2) 1.14x.
        block_work=1e8,
        shared_block_work=1e8,
        shared_level_work=0.0,
        # The tiny models' pooling (work 5e5-2.4e6) is host-bound: counted as not paying, as their merging.
        kv_work=1e8,
    ),
    ("cpu", "transformer"): PaysThresholds(
        kv_load=3.0,
        kv4_load=0.0,
        # Every --quick transformer (work 2e5-1e6 per block: widths 16-32) 0.17-0.95x; PixArt at 512 px b2
        # (work 2.6e9, docs/benchmarks.md at d03cce9) 1.15x / 1.17x / 1.34x; one block of Qwen-Image, Chroma,
        # Z-Image at 1024 px (9e10-1.2e11) 1.25x-1.56x, so depth does not matter here.
        block_work=1e8,
        shared_block_work=1e8,
        shared_level_work=0.0,
        kv_work=1e8,
    ),
}

#: Device types without figures of their own take these (the GPU's, the stricter).
FALLBACK_DEVICE = "cuda"

#: The table in force: `(device type, group) -> PaysThresholds`. Swap it with `pays_table`.
PAYS_TABLE: dict[tuple[str, str], PaysThresholds] = dict(THRESHOLDS)


@contextlib.contextmanager
def pays_table(table: Mapping[tuple[str, str], PaysThresholds] | PaysThresholds) -> Iterator[None]:
    """Use `table` (or one `PaysThresholds` for every device type and group) as the rule inside the block.

    Decisions already made for a grid are kept by each model (made again after `remove_tome` / `apply_tome`).

    Example:
        >>> from tome_processors.pays import ALWAYS, pays_table, thresholds_for
        >>> with pays_table(ALWAYS):
        ...     thresholds_for("cuda", "unet").kv_load
        0.0
    """
    saved = dict(PAYS_TABLE)
    PAYS_TABLE.clear()
    if isinstance(table, PaysThresholds):
        PAYS_TABLE.update({key: table for key in THRESHOLDS})
        PAYS_TABLE[("*", "*")] = table
    else:
        PAYS_TABLE.update(table)
    try:
        yield
    finally:
        PAYS_TABLE.clear()
        PAYS_TABLE.update(saved)


def thresholds_for(device_type: str, group: str) -> PaysThresholds:
    """The thresholds in force for `device_type` (`"cuda"`, `"cpu"`, ...) and `group` (`group_of`)."""
    for key in ((device_type, group), (FALLBACK_DEVICE, group), ("*", "*")):
        if key in PAYS_TABLE:
            return PAYS_TABLE[key]
    raise KeyError(f"Expected thresholds for ({device_type!r}, {group!r}) in the pays table, but got none.")


@dataclass(frozen=True)
class Verdict:
    """What the rule says about one site: `factor` 0 merges nothing there; else it merges (K/V pooling: the
    window side it pools with, `kv_factor` or 2 where a wider one did not pay more); `why` says why."""

    factor: int
    why: str
    kind: str  # the measured figures that apply: "kv2", "kv4", "merge" or "shared"
    value: float  # the site's load (K/V pooling) or work (merging)


def judge(
    config: ToMeConfig, group: str, tokens: int, width: int, depth: int, device_type: str, level: int = 1
) -> Verdict:
    """The rule at one site that `config` merges: `tokens` per sample, blocks of `width` channels, `depth` of them,
    at downsample `level` (which picks the K/V pooling window side, `config.kv_factor_at`).

    Example:
        >>> from tome_processors import ToMeConfig
        >>> fast = ToMeConfig.from_preset("fast", "unet")
        >>> judge(fast, "unet", tokens=128 * 128, width=320, depth=2, device_type="cuda").factor  # SD1.5, 1024 px
        4
        >>> judge(fast, "unet", tokens=128 * 128, width=640, depth=2, device_type="cuda").factor  # SDXL, 2048 px
        2
    """
    rule = thresholds_for(device_type, group)
    where = f"on {device_type}"
    if config.mode == "downsample_kv":
        load = tokens / max(width, 1)
        if rule.kv_work and float(tokens) * width * (tokens + width) < rule.kv_work:
            why = f"K/V pooling does not pay {where} below {rule.kv_work:.2g} work per block"
            return Verdict(0, why, "kv2", load)
        if load < rule.kv_load:
            why = f"K/V pooling does not pay {where} below {rule.kv_load:g} tokens per channel"
            return Verdict(0, why, "kv2", load)
        factor = config.kv_factor_at(level)
        if factor >= 4 and load < rule.kv4_load:
            why = f"pools 2x2: {factor}x{factor} pays more than 2x2 {where} from {rule.kv4_load:g}"
            return Verdict(2, why + " tokens per channel", "kv2", load)
        kind = "kv4" if factor >= 4 else "kv2"
        return Verdict(factor, f"pays {where} from {rule.kv_load:g} tokens per channel", kind, load)
    work = float(tokens) * width * (tokens + width)
    if config.share_level:
        if work < rule.shared_block_work:
            why = f"a shared matching does not pay {where} below {rule.shared_block_work:.2g} work per block"
            return Verdict(0, why, "shared", work)
        if depth * work < rule.shared_level_work:
            why = f"a shared matching does not pay {where} below {rule.shared_level_work:.2g} work per level"
            return Verdict(0, f"{why} ({depth} blocks)", "shared", work)
        return Verdict(1, f"pays {where} from {rule.shared_block_work:.2g} work per block", "shared", work)
    if work < rule.block_work:
        return Verdict(0, f"merging does not pay {where} below {rule.block_work:.2g} work per block", "merge", work)
    return Verdict(1, f"pays {where} from {rule.block_work:.2g} work per block", "merge", work)


def site_tokens(grid: tuple[int, int], level: int, frames: int = 1) -> int:
    """Image tokens of one sample at downsample `level` of a `grid` of `frames` frames (each side rounded up).

    Example:
        >>> site_tokens((128, 128), 2)
        4096
    """
    return frames * math.ceil(grid[0] / level) * math.ceil(grid[1] / level)


@dataclass(frozen=True)
class SiteShape:
    """One block's static shape: its downsample level and its width (channels)."""

    level: int
    width: int


def decide(
    config: ToMeConfig,
    group: str,
    shapes: tuple[SiteShape, ...],
    grid: tuple[int, int],
    frames: int,
    device_type: str,
    max_downsample: int,
) -> tuple[tuple[int, ...], dict[tuple[int, int], Verdict]]:
    """Every block's verdict factor (0: nothing merged) for one grid and device type, and each site's `Verdict`.

    A site is the blocks of one level and width. Levels `config` does not merge get factor 0 and no verdict.
    Kept per process for each setting and table in force: a model's first forward after `apply_tome` (ToMe
    turned on again, or on another model of the same shape) finds it made.
    """
    rule = thresholds_for(device_type, group)
    factors, verdicts = _decide(config, group, shapes, grid, frames, device_type, max_downsample, rule)
    return factors, dict(verdicts)  # a dict of its own: the cached one stays as made


@functools.lru_cache(maxsize=256)
def _decide(
    config: ToMeConfig,
    group: str,
    shapes: tuple[SiteShape, ...],
    grid: tuple[int, int],
    frames: int,
    device_type: str,
    max_downsample: int,
    rule: PaysThresholds,  # the table's entry in force: a key, so that `pays_table` is never answered from the cache
) -> tuple[tuple[int, ...], dict[tuple[int, int], Verdict]]:
    depth: dict[tuple[int, int], int] = {}
    for shape in shapes:
        depth[(shape.level, shape.width)] = depth.get((shape.level, shape.width), 0) + 1
    verdicts: dict[tuple[int, int], Verdict] = {}
    for level, width in depth:
        if config.level_ratio(level, max_downsample) > 0:
            tokens = site_tokens(grid, level, frames)
            verdicts[(level, width)] = judge(config, group, tokens, width, depth[(level, width)], device_type, level)
    factors = tuple(verdicts[(s.level, s.width)].factor if (s.level, s.width) in verdicts else 0 for s in shapes)
    return factors, verdicts


def attention_width(attn: object) -> int:
    """The channels of an attention module's input (`query_dim`, else its query projection's input features: `to_q`,
    Kandinsky's `to_query`; 0 if none)."""
    width = getattr(attn, "query_dim", None)
    if isinstance(width, int) and width > 0:
        return width
    projection = getattr(attn, "to_q", None) or getattr(attn, "to_query", None)
    return int(getattr(projection, "in_features", 0) or 0)


def site_shapes(model: torch.nn.Module, family: Family, sites: list[BlockSite]) -> tuple[SiteShape, ...]:
    """Each block's `SiteShape`, in the family's block order (static: read once, when ToMe is installed)."""
    levels = family.block_levels(model, [site.module for site in sites])
    widths = [attention_width(site.attentions[0].module) if site.attentions else 0 for site in sites]
    return tuple(SiteShape(level, width) for level, width in zip(levels, widths, strict=True))


@dataclass(frozen=True)
class Measured:
    """A measured whole-forward speed-up of a configuration whose merged site had this load or work."""

    value: float
    speedup: float
    source: str


#: The figures the thresholds above come from, per `(device type, group, kind)` (kinds as in `Verdict`), sorted
#: by value: what `predicted_speedup` interpolates. GPU: H100 at 772857c, H200 at d4b8084; CPU: this 2-core VM.
MEASURED: dict[tuple[str, str, str], tuple[Measured, ...]] = {
    ("cuda", "unet", "kv2"): (
        Measured(6.4, 0.98, "SDXL 1024 px b2 balanced, H200 d4b8084"),
        Measured(12.8, 1.02, "SD1.5 512 px b2 balanced, H200 d4b8084"),
        Measured(25.6, 1.10, "SDXL 2048 px b1 balanced, H100 772857c"),
        Measured(51.2, 1.09, "SD1.5 1024 px b2 balanced, H100 772857c"),
        Measured(204.8, 1.74, "SD1.5 2048 px b1 balanced, H100 772857c"),
    ),
    ("cuda", "unet", "kv4"): (
        Measured(6.4, 0.95, "SDXL 1024 px b2 fast, H200 d4b8084"),
        Measured(12.8, 1.01, "SD1.5 512 px b2 fast, H200 d4b8084"),
        Measured(25.6, 1.00, "SDXL 2048 px b1 4x4 avg pooling, H100 772857c"),
        Measured(51.2, 1.17, "SD1.5 1024 px b2 4x4 avg pooling, H100 772857c"),
        Measured(204.8, 2.35, "SD1.5 2048 px b1 fast, H100 772857c"),
    ),
    ("cuda", "unet", "merge"): (
        Measured(5.8e9, 0.84, "SD1.5 512 px b2 exact, H200 d4b8084"),
        Measured(1.24e10, 0.90, "SDXL 1024 px b2 exact, H200 d4b8084"),
        Measured(8.8e10, 0.95, "SD1.5 1024 px b2 exact, H100 772857c"),
        Measured(1.8e11, 0.95, "SDXL 2048 px b1 exact, H100 772857c"),
        Measured(1.4e12, 1.52, "SD1.5 2048 px b1 exact, H100 772857c"),
    ),
    ("cuda", "transformer", "merge"): (
        Measured(2.5e10, 0.71, "PixArt 1024 px b2 exact, H200 d4b8084"),
        Measured(9.0e10, 0.98, "FLUX.1 1.00x, Chroma 0.98x, Qwen-Image 0.96x at 1024 px b2 exact, H200 d4b8084"),
        Measured(1.25e11, 1.01, "Z-Image 1024 px b2 exact, H200 d4b8084"),
        Measured(2.6e11, 1.11, "FLUX.2 1024 px b2 exact (LTX-2 1.06x), H200 d4b8084"),
        Measured(1.2e12, 1.67, "HunyuanVideo 544x960x33 exact, H200 d4b8084"),
        Measured(1.7e12, 1.78, "Wan2.1 480x832x81 exact, H200 d4b8084"),
        Measured(5.2e12, 3.50, "HunyuanVideo 1.5 480x848x121 exact, H200 d4b8084"),
    ),
    ("cuda", "transformer", "shared"): (
        Measured(2.5e10, 0.96, "PixArt 1024 px b2 balanced, H200 d4b8084"),
        Measured(9.0e10, 1.15, "Chroma 1.15x, FLUX.1 1.17x at 1024 px b2 balanced (8 blocks), H200 d4b8084"),
        Measured(1.25e11, 1.16, "Z-Image 1024 px b2 balanced, H200 d4b8084"),
        Measured(2.6e11, 1.30, "FLUX.2 1024 px b2 balanced, H200 d4b8084"),
        Measured(1.2e12, 2.66, "HunyuanVideo 544x960x33 fast, H200 d4b8084"),
        Measured(1.7e12, 2.65, "Wan2.1 480x832x81 fast, H200 d4b8084"),
        Measured(5.2e12, 8.17, "HunyuanVideo 1.5 480x848x121 fast, H200 d4b8084"),
    ),
    ("cpu", "unet", "kv2"): (
        Measured(1.0, 0.96, "tiny SDXL (--quick) balanced, a442b15"),
        Measured(3.2, 1.03, "SD1.5 256 px b2 balanced, a442b15"),
        Measured(8.0, 1.05, "tiny SD1.5 (--quick) balanced, a442b15"),
        Measured(12.8, 1.20, "SD1.5 512 px b2 balanced, f0ce884"),
        Measured(51.2, 1.54, "SD1.5 1024 px b1 2x2 pooling, docs/options.md"),
    ),
    ("cpu", "unet", "kv4"): (
        Measured(3.2, 1.08, "SD1.5 256 px b2 fast, a442b15"),
        Measured(8.0, 1.09, "tiny SD1.5 (--quick) fast, a442b15"),
        Measured(12.8, 1.23, "SD1.5 512 px b2 fast, f0ce884"),
        Measured(51.2, 1.79, "SD1.5 1024 px b1 4x4 pooling, docs/options.md"),
    ),
    ("cpu", "unet", "merge"): (
        Measured(2.4e6, 0.89, "tiny SD1.5 (--quick) exact, a442b15"),
        Measured(4.4e8, 1.04, "SD1.5 256 px b2 exact, a442b15"),
        Measured(5.8e9, 1.14, "SD1.5 512 px b2 exact, f0ce884"),
        Measured(8.8e10, 1.55, "SD1.5 1024 px b1 ToMe 0.5, docs/options.md"),
    ),
    ("cpu", "transformer", "merge"): (
        Measured(2e5, 0.25, "tiny PixArt (--quick) exact, a442b15"),
        Measured(2.6e9, 1.15, "PixArt 512 px b2 exact, d03cce9"),
        Measured(3.4e11, 1.18, "Wan2.1-1.3B one block, 480x832x33 exact, docs/benchmarks.md"),
    ),
    ("cpu", "transformer", "shared"): (
        Measured(2e5, 0.17, "tiny PixArt (--quick) balanced, a442b15"),
        Measured(2.6e9, 1.17, "PixArt 512 px b2 balanced, d03cce9"),
        Measured(9.0e10, 1.38, "Qwen-Image 1024 px b2 one block balanced, docs/benchmarks.md"),
    ),
}


def predicted_speedup(device_type: str, group: str, kind: str, value: float) -> tuple[float | None, str]:
    """The whole-forward speed-up the measured figures give at a site's load or work (log-interpolated between
    the two nearest, the nearest one's beyond them), and which figures; `(None, ...)` where none is measured.

    Example:
        >>> predicted_speedup("cuda", "unet", "kv2", 51.2)
        (1.09, 'SD1.5 1024 px b2 balanced, H100 772857c')
    """
    points = MEASURED.get((device_type, group, kind)) or MEASURED.get((FALLBACK_DEVICE, group, kind))
    if not points:
        return None, "no figures measured"
    if value <= points[0].value:
        return points[0].speedup, points[0].source
    for low, high in zip(points, points[1:], strict=False):
        if value <= high.value:
            if value == high.value:
                return high.speedup, high.source
            share = math.log(value / low.value) / math.log(high.value / low.value)
            speedup = round(low.speedup + share * (high.speedup - low.speedup), 2)
            return speedup, f"between {low.source} and {high.source}"
    return points[-1].speedup, points[-1].source
