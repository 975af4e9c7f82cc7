"""What `tome-processors bench --parallel` runs: how the model is split (`ParallelSpec`) and what every rank builds
and measures (`ParallelRequest`), apart from the spawning (`bench.parallel`) and the memory estimate
(`bench.rank_memory`), which both read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffusers import ContextParallelConfig, TensorParallelConfig

__all__ = ["ParallelRequest", "ParallelSpec", "parse_parallel"]


@dataclass(frozen=True)
class ParallelSpec:
    """How a model is split: `ulysses` x `ring` ranks of context parallelism, or `tp` ranks of tensor parallelism.

    Example:
        >>> parse_parallel("ulysses=2,ring=2").world_size
        4
    """

    ulysses: int = 1
    ring: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        """The processes it takes."""
        return self.ulysses * self.ring * self.tp

    def config(self) -> Any:
        """diffusers' config for `enable_parallelism`."""
        if self.tp > 1:
            return TensorParallelConfig(tp_degree=self.tp)
        return ContextParallelConfig(ulysses_degree=self.ulysses, ring_degree=self.ring)

    def __str__(self) -> str:
        parts = [f"{name}={value}" for name, value in (("ulysses", self.ulysses), ("ring", self.ring), ("tp", self.tp))]
        return ",".join(part for part in parts if not part.endswith("=1"))


def parse_parallel(text: str) -> ParallelSpec:
    """`"ulysses=2"`, `"ring=2"`, `"ulysses=2,ring=2"` or `"tp=2"` as a `ParallelSpec`.

    Raises:
        ValueError: another name, a degree below 2, or tensor parallelism with context parallelism.

    Example:
        >>> parse_parallel("tp=2")
        ParallelSpec(ulysses=1, ring=1, tp=2)
    """
    degrees: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in ("ulysses", "ring", "tp") or not value.isdigit() or int(value) < 2 or name in degrees:
            raise ValueError(
                "Expected --parallel as ulysses=N, ring=N, ulysses=N,ring=M or tp=N with each N >= 2, "
                f"but got {text!r}."
            )
        degrees[name] = int(value)
    if "tp" in degrees and len(degrees) > 1:
        raise ValueError(f"Expected tensor parallelism alone (diffusers combines it with no other), but got {text!r}.")
    return ParallelSpec(**degrees)


@dataclass(frozen=True)
class ParallelRequest:
    """What the ranks build and run (passed to each spawned rank)."""

    spec: ParallelSpec
    arch: str
    presets: tuple[str, ...]
    ratios: tuple[float, ...]
    rounds: int
    warmup: int
    resolution: int
    width: int | None
    frames: int | None
    layers: int | None
    batch: int
    seed: int
    threads: int
    device: str
    dtype: str
    quick: bool
