"""`ToMeConfig`: the one validated description of how tokens are merged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

MaxDownsample = Literal["auto", 1, 2, 4, 8]
_ALLOWED_DOWNSAMPLE = (1, 2, 4, 8)


def _expect(condition: bool, what: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"Expected {what}, but got {value!r}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ToMeConfig:
    """How Token Merging is applied. Frozen and validated on construction.

    The defaults follow tomesd (ToMe for SD), except that `max_downsample="auto"` picks the
    highest-resolution level that has attention, so SDXL is merged instead of silently skipped.

    Args:
        ratio: Share of the tokens to merge away, `r = int(N * ratio)`. From 0 up to the cap
            `1 - 1 / (sx * sy)` (0.75 for 2x2 windows), where every source token is merged.
        max_downsample: Merge only in blocks whose downsample factor (1 at the latent
            resolution, then 2, 4, 8) is at most this. `"auto"` is the highest-resolution level
            that has attention: 1 on SD1.x/SD2.x, 2 on SDXL.
        sx: Width of the window that holds one destination token.
        sy: Height of the window that holds one destination token.
        use_rand: Choose each window's destination at random (reproducibly, from `seed`) instead of
            its top-left token. Turned off for odd batch sizes, as in tomesd.
        merge_attn: Merge the tokens entering self-attention (recommended).
        merge_crossattn: Merge the tokens entering cross-attention (not recommended).
        merge_mlp: Merge the tokens entering the feed-forward (quality drops quickly).
        seed: Seeds the destination choice. The choice is a pure function of this seed, the
            denoising timestep and the block, so the same seed gives the same output every run and
            the global torch RNG is never used.

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
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _expect(_is_int(self.sx) and self.sx >= 1, "sx to be an integer >= 1", self.sx)
        _expect(_is_int(self.sy) and self.sy >= 1, "sy to be an integer >= 1", self.sy)
        _expect(_is_number(self.ratio), "ratio to be a number", self.ratio)
        cap = self.max_ratio
        _expect(
            0.0 <= self.ratio <= cap,
            f"ratio between 0 and {cap:g} (the cap 1 - 1/(sx*sy) for sx={self.sx}, sy={self.sy})",
            self.ratio,
        )
        _expect(
            self.max_downsample == "auto"
            or (_is_int(self.max_downsample) and self.max_downsample in _ALLOWED_DOWNSAMPLE),
            'max_downsample to be "auto", 1, 2, 4 or 8',
            self.max_downsample,
        )
        for flag in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            value = getattr(self, flag)
            _expect(isinstance(value, bool), f"{flag} to be a bool", value)
        _expect(_is_int(self.seed) and self.seed >= 0, "seed to be a non-negative integer", self.seed)

    @property
    def max_ratio(self) -> float:
        """The largest allowed ratio: every token but one per window merged."""
        return 1.0 - 1.0 / (self.sx * self.sy)

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
