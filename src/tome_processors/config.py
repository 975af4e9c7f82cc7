"""`ToMeConfig`: the one validated description of how tokens are merged."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .families import FAMILIES, Family, family_of

MaxDownsample = Literal["auto", 1, 2, 4, 8]
Mode = Literal["merge", "downsample_kv"]
KVPool = Literal["avg", "nearest"]
_ALLOWED_DOWNSAMPLE = (1, 2, 4, 8)
_MODES = ("merge", "downsample_kv")
_KV_POOLS = ("avg", "nearest")
_SIMILARITY_DTYPES = (None, "float32", "bfloat16", "float16")
Matching = Literal["global", "window"]
_MATCHINGS = ("global", "window")
Preset = Literal["exact", "balanced", "fast"]
#: The preset names, from the most faithful to the fastest.
PRESETS: tuple[str, ...] = ("exact", "balanced", "fast")
#: The fields that take a number (any real or integer scalar, NumPy's included; never a bool).
_NUMBER_FIELDS = (
    "ratio", "max_downsample", "sx", "sy", "st", "seed", "kv_factor", "recompute_every", "ratio_start",
    "num_train_timesteps",
)  # fmt: skip


def _expect(condition: bool, what: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"Expected {what}, but got {value!r}.")


def _is_int(value: Any) -> bool:
    # Any integer (Python's, NumPy's: `numbers.Integral`), but no bool.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # Any real number (Python's, NumPy's `float32` / `float64` / integers: `numbers.Real`), but no bool.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """A NumPy (or other `numbers`) scalar as the Python int or float it stands for; Python numbers unchanged."""
    if type(value) in (int, float) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


@dataclass(frozen=True)
class ToMeConfig:
    """How Token Merging is applied. Frozen and validated on construction.

    The defaults follow tomesd (ToMe for SD), except that `max_downsample="auto"` picks the
    highest-resolution level that has attention, so SDXL is merged instead of silently skipped.
    The options from `mode` on go beyond tomesd; their defaults keep tomesd's behaviour.
    Numbers may be any real or integer scalar (NumPy's `float32`, `int64`, ...), stored as the Python
    float or int they stand for; bools are refused where a number is expected.

    Args:
        ratio: Share of the tokens to merge away, `r = int(N * ratio)`. From 0 up to the cap
            `1 - 1 / (sx * sy)` (0.75 for 2x2 windows), where every source token is merged.
        max_downsample: Merge only in blocks whose downsample factor (1 at the latent
            resolution, then 2, 4, 8) is at most this. `"auto"` is the highest-resolution level
            that has attention: 1 on SD1.x/SD2.x, 2 on SDXL.
        sx: Width of the window that holds one destination token.
        sy: Height of the window that holds one destination token.
        st: Frames that the window spans, on video models (Wan). 1 merges each frame on its own
            (tomesd frame by frame: windows and matching inside a frame). From 2 on, windows of
            `st x sy x sx` tokens span neighbouring frames and a token may merge with a destination in
            any frame of the clip, so a static background collapses across time (`sx=sy=1` merges
            across time only). Image models accept only 1.
        use_rand: Choose each window's destination at random (reproducibly, from `seed`) instead of
            its top-left token. Turned off for odd batch sizes, as in tomesd, on the families whose
            pipelines batch classifier-free guidance (UNets, PixArt, SD3, LTX, Z-Image); random at every
            batch size on FLUX.1, FLUX.2, Chroma, Qwen-Image, Wan and HunyuanVideo (docs/options.md).
        merge_attn: Merge the tokens entering self-attention (recommended).
        merge_crossattn: Merge the tokens entering cross-attention (not recommended).
        merge_mlp: Merge the tokens entering the feed-forward (quality drops quickly).
        seed: Seeds the destination choice. The choice is a pure function of this seed, the
            denoising timestep and the block, so the same seed gives the same output every run and
            the global torch RNG is never used.
        mode: `"merge"` (ToMe: merge tokens before attention, unmerge after) or `"downsample_kv"`
            (ToDo, arXiv 2402.13573: keep every query, pool the keys and values of self-attention
            over `kv_factor x kv_factor` windows; no similarity is computed at all).
        kv_factor: the pooling window side for `"downsample_kv"` (2 keeps a quarter of the keys).
        kv_pool: `"avg"` (mean of each window) or `"nearest"` (its top-left token, cheaper).
        level_kv_factors: a pooling window side per downsample level for `"downsample_kv"`, e.g. `{2: 2}`;
            levels not listed pool `kv_factor`. Stored as sorted `(level, factor)` pairs (hashable).
        share_level: compute one merge per level and forward, from the first block of the level,
            and share it with the other blocks of that level (cheaper, slightly different).
        recompute_every: recompute merges every this many denoising steps and reuse them in
            between (1 = every forward, as tomesd). Counted on the host per branch (the forwards with
            one text input): a forward with another timestep object than its branch's last is a new
            step, so guidance run as two calls per step counts steps, not calls, and each call reuses
            its own merges. The timestep is never read back from the device.
        level_ratios: a ratio per downsample level, e.g. `{1: 0.6, 2: 0.3}`; levels not listed are
            not merged and `max_downsample` is not used. Stored as sorted `(level, ratio)` pairs, so
            the config stays hashable.
        ratio_start: the ratio at the noisiest timestep; it moves linearly to `ratio` (or the
            level's ratio) at timestep 0. `None` keeps the ratio constant. The merged shape follows
            the timestep, which is taken from the scheduler's timesteps copied to the host once per
            generation when applied to a pipeline (or `set_timestep_schedule`), else read on the host
            once per forward.
        num_train_timesteps: the timestep scale of `ratio_start` (1000 for Stable Diffusion).
        similarity_dtype: compute the similarity matrix in this dtype (`"bfloat16"` is faster than
            float32 on CPUs with native bfloat16, AVX512-BF16 or AMX); the chosen pairs are then
            scored in the metric's dtype for the ranking. `None` uses the metric's dtype, as tomesd
            does.
        matching: where a source token looks for its destination. `"global"` (tomesd): the most
            similar destination anywhere in the grid (or frame, or clip with `st > 1`), one `(N/2) x (N/2)`
            similarity product per matching. `"window"`: only its own window's destination (a source
            outside every full window: the nearest window's), `N` dot products; the sources most similar
            to their own destination merge. Merged tokens then stay beside their destination, which
            keeps rotary positions close; on the trained video model it changes the prediction less
            than global matching at a higher ratio (docs/options.md). `similarity_dtype` has no
            product to act on there.
        pays_only: merge only where the measured figures say merging makes the forward faster for the device
            type, token count and depth at hand (`tome_processors.pays`; `explain_tome` shows each site's
            verdict), and elsewhere nothing; with `kv_factor >= 4`, pool 2x2 where 4x4 did not pay more. Decided
            once per token grid and device type from shapes alone. Every preset sets it; `False` (the default,
            as tomesd) merges wherever the other options say.

    Example:
        >>> from tome_processors import ToMeConfig
        >>> ToMeConfig(ratio=0.6, max_downsample=2).ratio
        0.6
        >>> ToMeConfig(ratio=0.9)
        Traceback (most recent call last):
        ...
        ValueError: Expected ratio between 0 and 0.75 (the cap 1 - 1/(sx*sy) for sx=2, sy=2), but got 0.9.
    """

    ratio: float = 0.5
    max_downsample: MaxDownsample = "auto"
    sx: int = 2
    sy: int = 2
    st: int = 1
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int = 0
    mode: Mode = "merge"
    kv_factor: int = 2
    kv_pool: KVPool = "avg"
    share_level: bool = False
    recompute_every: int = 1
    level_ratios: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    ratio_start: float | None = None
    num_train_timesteps: int = 1000
    similarity_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    matching: Matching = "global"
    pays_only: bool = False
    level_kv_factors: Mapping[int, int] | tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        _expect(_is_int(self.sx) and self.sx >= 1, "sx to be an integer >= 1", self.sx)
        _expect(_is_int(self.sy) and self.sy >= 1, "sy to be an integer >= 1", self.sy)
        _expect(_is_int(self.st) and self.st >= 1, "st to be an integer >= 1", self.st)
        _expect(_is_number(self.ratio), "ratio to be a number", self.ratio)
        cap = self.max_ratio
        window = f"1 - 1/(sx*sy) for sx={self.sx}, sy={self.sy}"
        if self.st != 1:
            window = f"1 - 1/(st*sx*sy) for st={self.st}, sx={self.sx}, sy={self.sy}"
        _expect(0.0 <= self.ratio <= cap, f"ratio between 0 and {cap:g} (the cap {window})", self.ratio)
        _expect(
            self.max_downsample == "auto"
            or (_is_int(self.max_downsample) and self.max_downsample in _ALLOWED_DOWNSAMPLE),
            'max_downsample to be "auto", 1, 2, 4 or 8',
            self.max_downsample,
        )
        _expect(self.mode in _MODES, 'mode to be "merge" or "downsample_kv"', self.mode)
        _expect(_is_int(self.kv_factor) and self.kv_factor >= 1, "kv_factor to be an integer >= 1", self.kv_factor)
        _expect(self.kv_pool in _KV_POOLS, 'kv_pool to be "avg" or "nearest"', self.kv_pool)
        _expect(
            self.similarity_dtype in _SIMILARITY_DTYPES,
            'similarity_dtype to be None, "float32", "bfloat16" or "float16"',
            self.similarity_dtype,
        )
        _expect(self.matching in _MATCHINGS, 'matching to be "global" or "window"', self.matching)
        _expect(
            _is_int(self.recompute_every) and self.recompute_every >= 1,
            "recompute_every to be an integer >= 1",
            self.recompute_every,
        )
        _expect(
            _is_int(self.num_train_timesteps) and self.num_train_timesteps >= 1,
            "num_train_timesteps to be an integer >= 1",
            self.num_train_timesteps,
        )
        if self.ratio_start is not None:
            _expect(
                _is_number(self.ratio_start) and 0.0 <= self.ratio_start <= cap,
                f"ratio_start to be None or between 0 and {cap:g}",
                self.ratio_start,
            )
        self._store_per_level(
            "level_ratios", "{1: 0.6, 2: 0.3}", lambda r: _is_number(r) and 0.0 <= r <= cap, f"between 0 and {cap:g}"
        )
        self._store_per_level("level_kv_factors", "{2: 2}", lambda f: _is_int(f) and f >= 1, "to be integers >= 1")
        for flag in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "share_level", "pays_only"):
            value = getattr(self, flag)
            _expect(isinstance(value, bool), f"{flag} to be a bool", value)
        _expect(_is_int(self.seed) and self.seed >= 0, "seed to be a non-negative integer", self.seed)
        for name in _NUMBER_FIELDS:  # NumPy scalars stored as the Python numbers they stand for
            object.__setattr__(self, name, _plain(getattr(self, name)))

    def _store_per_level(self, name: str, example: str, valid: Any, what: str) -> None:
        """Check the per-level mapping in field `name` (None, or level -> value with `valid(value)`), and store it as
        sorted pairs of plain numbers so the config stays hashable (merges are cached per config)."""
        mapping = getattr(self, name)
        if mapping is None:
            return
        _expect(isinstance(mapping, (Mapping, tuple)), f"{name} to be a mapping such as {example}, or None", mapping)
        for level, value in dict(mapping).items():
            _expect(_is_int(level) and level in _ALLOWED_DOWNSAMPLE, f"{name} keys among 1, 2, 4, 8", level)
            _expect(valid(value), f"{name} values {what}", value)
        pairs = sorted((_plain(level), _plain(value)) for level, value in dict(mapping).items())
        object.__setattr__(self, name, tuple(pairs))

    @property
    def max_ratio(self) -> float:
        """The largest allowed ratio: every token but one per window merged."""
        return 1.0 - 1.0 / (self.st * self.sx * self.sy)

    def level_ratio(self, downsample: int, max_downsample: int) -> float:
        """The ratio at a level before any timestep schedule; 0 where that level is not merged."""
        if self.level_ratios is not None:
            return dict(self.level_ratios).get(downsample, 0.0)
        return self.ratio if downsample <= max_downsample else 0.0

    def kv_factor_at(self, downsample: int) -> int:
        """The K/V pooling window side at a level: its `level_kv_factors` entry, else `kv_factor`.

        Example:
            >>> ToMeConfig(mode="downsample_kv", kv_factor=4, level_kv_factors={2: 2}).kv_factor_at(2)
            2
        """
        if self.level_kv_factors is not None:
            return dict(self.level_kv_factors).get(downsample, self.kv_factor)
        return self.kv_factor

    def ratio_at(self, level_ratio: float, timestep: float | None) -> float:
        """`level_ratio` moved along the timestep schedule (`ratio_start`), if there is one."""
        if self.ratio_start is None or timestep is None:
            return level_ratio
        noise = min(max(timestep / self.num_train_timesteps, 0.0), 1.0)
        return level_ratio + (self.ratio_start - level_ratio) * noise

    def replace(self, **changes: Any) -> ToMeConfig:
        """A copy with `changes` applied (validated again); the original is untouched."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, config: ToMeConfig | None = None, **kwargs: Any) -> ToMeConfig:
        """`config` updated with `kwargs`, or a new config from `kwargs` alone.

        Unknown names raise a `TypeError` that lists the known ones.
        """
        if config is not None and not isinstance(config, ToMeConfig):
            raise TypeError(f"Expected config to be a ToMeConfig or None, but got {type(config).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Expected options among {sorted(known)}, but got unknown {unknown}.")
        if config is None:
            return cls(**kwargs)
        return config.replace(**kwargs) if kwargs else config

    @classmethod
    def for_model(cls, model: Any, preset: Preset | None = None, **overrides: Any) -> ToMeConfig:
        """The config `apply_tome` uses for `model`: its family's defaults, a preset, then `overrides`.

        Args:
            model: a supported model (a UNet, PixArt, SD3 or Flux transformer), a pipeline's
                denoiser, or a family name (`"unet"`, `"pixart"`, `"sd3"`, `"flux"`).
            preset: `None` for the family's defaults (tomesd's algorithm and options, at the
                family's default ratio), or one of `PRESETS`.
            **overrides: any `ToMeConfig` field; explicit options win over the preset.

        Example:
            >>> from tome_processors import ToMeConfig
            >>> ToMeConfig.for_model("pixart").ratio
            0.4
            >>> ToMeConfig.for_model("pixart", "balanced", ratio=0.3).share_level
            True
        """
        on = model if isinstance(model, torch.nn.Module) else None
        return cls.for_family(_family(model), preset, on, **overrides)

    @classmethod
    def for_family(
        cls, family: Family, preset: Preset | None = None, model: torch.nn.Module | None = None, **overrides: Any
    ) -> ToMeConfig:
        """`for_model` where the family is known: its defaults, a preset (on `model`, where a preset depends on the
        model), then `overrides`.

        Example:
            >>> from tome_processors.families import FAMILIES
            >>> ToMeConfig.for_family(FAMILIES["pixart"](), "balanced").share_level
            True
        """
        fields = dict(family.defaults)
        if preset is not None:
            _expect(
                isinstance(preset, str) and preset in PRESETS, f"preset to be one of {list(PRESETS)} or None", preset
            )
            fields = family.preset_options(preset, model)
        return cls.from_kwargs(cls(**fields), **overrides)

    @classmethod
    def from_preset(cls, name: Preset, model: Any, **overrides: Any) -> ToMeConfig:
        """The preset `name` for `model`'s family, with `overrides` applied on top.

        `"exact"` is tomesd's algorithm (per-block matching, attention only) at the family's default
        ratio; `"balanced"` and `"fast"` are chosen per family from measured speed and quality
        (docs/options.md has the table). Every preset sets `pays_only=True`: it merges only where that pays
        on the device and size at hand (`pays_only=False` among the overrides merges wherever it selects).
        `model` is a model or a family name, as in `for_model`.

        Example:
            >>> from tome_processors import ToMeConfig
            >>> ToMeConfig.from_preset("fast", "sd3").share_level
            True
            >>> ToMeConfig.from_preset("exact", "unet") == ToMeConfig(pays_only=True)
            True
        """
        _expect(isinstance(name, str) and name in PRESETS, f"preset to be one of {list(PRESETS)}", name)
        return cls.for_model(model, name, **overrides)


def _family(model: Any) -> Family:
    """The family of a model, or of a family name."""
    if isinstance(model, str):
        _expect(model in FAMILIES, f"a model or a family name among {sorted(FAMILIES)}", model)
        return FAMILIES[model]()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Expected a diffusers model or a family name, but got {type(model).__name__}.")
    return family_of(model)
