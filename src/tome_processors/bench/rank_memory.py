"""The memory one rank of `tome-processors bench --parallel` takes, estimated before any rank is spawned, and the
check that refuses a run this machine cannot hold.

A rank that runs out of the machine's memory is killed by the operating system (SIGKILL), and what shows is the
other ranks' gloo "Connection closed by peer". So the parent estimates a rank's peak first and refuses, naming the
estimate and the sizes (`--layers`, `--frames`, fewer rows) that would fit; it does not shrink the run on its own,
since the size is what the rows measure.

A rank on the CPU holds, at its peak:

- the weights: one copy of the model per row (the baseline, each preset, each ratio), `copies x parameters x bytes
  an element`, or the float32 build (4 bytes a parameter) where that is more (a float16 or bfloat16 run casts the
  model after building it). The parameters are counted on a model built on the meta device at the run's depth.
  Under tensor parallelism each copy keeps only its shard of the planned layers: the estimate, which counts whole
  copies, is then an upper bound;
- the activations of one forward: `ACTIVATION_WIDTHS x tokens x width x bytes an element`, with `width` the first
  self-attention's (heads x head dim) and `tokens` the rank's share of the sequence (the sequence / the ranks under
  context parallelism, the whole sequence under tensor parallelism), times the batch. The sequence is what the first
  self-attention of a one-block meta model gets at the run's size. `ACTIVATION_WIDTHS` is measured on the CPU in
  float32: a rank of `--parallel ulysses=2 --arch wan --layers 2 --resolution 240 --width 416 --frames 33 --presets
  balanced` (1,755 tokens a rank) peaked at 1.79 GiB resident, 0.41 GiB above its two copies and its process: 40
  widths a token. One process alone, a Wan2.1-1.3B-wide block at 390 to 6,630 tokens, grew by 13 to 24 widths a token
  (the feed-forward's hidden layer alone is 5.8 widths, held twice across its activation); the all-to-alls' buffers
  make the rest. The other families' feed-forwards are narrower against their width;
- `PROCESS_BYTES` for the process itself (Python, torch and diffusers imported: 0.44 GiB measured, gloo's buffers;
  the same run at one block and one frame, 195 tokens a rank, peaked at 1.06 GiB, as estimated).

On CUDA the ranks build the model in float32 on the host before moving it to their GPU: the check holds the host to
that build (`4 x parameters` a rank); a GPU's own shortage shows as that rank's CUDA out-of-memory error.

The memory available (`psutil.virtual_memory().available`) is shared by the ranks on this host: a run fits where the
estimate is at most the available memory / the ranks.

Example:
    >>> memory = RankMemory(parameters=10**9, copies=2, element_size=4, tokens=1_000, width=1_000)
    >>> memory.weight_bytes, memory.activation_bytes
    (8000000000, 160000000)
    >>> round(memory.total_bytes / GIB, 2)
    8.1
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import psutil
import torch

from ..families import find_family
from .archs import ARCHS
from .dit import (
    _DEPTH_FIELDS,
    VIDEO_ARCHITECTURES,
    VIDEO_DEFAULTS,
    VIDEO_STRIDES,
    build_transformer,
    latent_frames,
    make_transformer_inputs,
)
from .meta import resolve_dtype

if TYPE_CHECKING:
    from .parallel import ParallelRequest

__all__ = [
    "ACTIVATION_WIDTHS",
    "GIB",
    "NotEnoughMemory",
    "PROCESS_BYTES",
    "RankMemory",
    "available_memory",
    "check_rank_memory",
    "estimate_rank_memory",
]

GIB = 2**30
#: The activations of one forward, in widths a token (module doc: measured on a rank of a Wan2.1-1.3B-wide run).
ACTIVATION_WIDTHS = 40
#: A rank's process without its model: Python, torch, diffusers and gloo.
PROCESS_BYTES = GIB // 2


class NotEnoughMemory(ValueError):
    """A `bench --parallel` run whose ranks would not fit this machine's memory (the message says what would)."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimated peak (module doc).

    Attributes:
        parameters: the model's parameters (the whole model's, also under tensor parallelism).
        copies: copies of the model a rank holds: one per row.
        element_size: bytes an element in the run's dtype.
        tokens: the tokens of the rank's share of one forward's sequence, times the batch.
        width: the first self-attention's width (heads x head dim).
        host_build_only: CUDA ranks: only the float32 build is on the host (no copies, no activations there).

    Example:
        >>> RankMemory(10**9, 2, 4, 1_000, 1_000, host_build_only=True).weight_bytes  # float32 on the host
        4000000000
    """

    parameters: int
    copies: int
    element_size: int
    tokens: int
    width: int
    host_build_only: bool = False

    @property
    def weight_bytes(self) -> int:
        """The copies of the weights, or the float32 build where that is more."""
        build = 4 * self.parameters
        if self.host_build_only:
            return build
        return max(self.copies * self.parameters * self.element_size, build)

    @property
    def activation_bytes(self) -> int:
        """One forward's activations at the rank's tokens."""
        if self.host_build_only:
            return 0
        return ACTIVATION_WIDTHS * self.tokens * self.width * self.element_size

    @property
    def total_bytes(self) -> int:
        """The rank's estimated peak: weights, activations and the process."""
        return self.weight_bytes + self.activation_bytes + PROCESS_BYTES

    def describe(self) -> str:
        """What the estimate is made of, for the messages.

        Example:
            >>> RankMemory(10**9, 2, 4, 1_000, 1_000).describe()
            '2 copies of the model (one per row) of 1.00 B parameters at 4 bytes each (7.45 GiB), the activations of \
one forward at 1,000 tokens (0.15 GiB) and 0.50 GiB for the process'
        """
        if self.host_build_only:
            return (
                f"the model's float32 build on the host, {self.parameters / 1e9:.2f} B parameters "
                f"({_gib(self.weight_bytes)}), and {_gib(PROCESS_BYTES)} for the process"
            )
        return (
            f"{self.copies} {'copy' if self.copies == 1 else 'copies'} of the model (one per row) of "
            f"{self.parameters / 1e9:.2f} B parameters at {self.element_size} bytes each ({_gib(self.weight_bytes)}), "
            f"the activations of one forward at {self.tokens:,} tokens ({_gib(self.activation_bytes)}) and "
            f"{_gib(PROCESS_BYTES)} for the process"
        )


def _gib(size: float) -> str:
    return f"{size / GIB:.2f} GiB"


def available_memory() -> int:
    """The memory this machine has available now, in bytes (`psutil.virtual_memory().available`)."""
    return int(psutil.virtual_memory().available)


def _parameters(request: ParallelRequest, layers: int | None) -> int:
    model = build_transformer(request.arch, quick=request.quick, layers=layers, device="meta", dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def _sequence(request: ParallelRequest) -> tuple[int, int]:
    """The whole sequence's tokens at the first self-attention (one sample) and its width, from a one-block meta
    model's forward at the run's size."""
    from .parallel import first_attention_queries  # the bench's own count (`bench.parallel` imports this module)

    model = build_transformer(request.arch, quick=request.quick, layers=1, device="meta", dtype=torch.float32)
    inputs = make_transformer_inputs(
        model,
        request.arch,
        1,
        request.resolution,
        device="meta",
        frames=request.frames,
        width=request.width,
        quick=request.quick,
    )
    with torch.no_grad():
        tokens = first_attention_queries(model, lambda: model(**inputs.kwargs, return_dict=False))
    attention = find_family(model).blocks(model)[0].attentions[0].module
    return tokens, attention.to_q.out_features


def estimate_rank_memory(request: ParallelRequest) -> RankMemory:
    """One rank's estimated peak for `request` (module doc), counted on meta-device models: nothing is allocated.

    Example:
        >>> from tome_processors.bench.parallel import ParallelRequest, parse_parallel
        >>> request = ParallelRequest(parse_parallel("ulysses=2"), "wan", ("balanced",), (), 3, 1, 480, 832, 33, 1,
        ...                           1, 0, 1, "cpu", "float32", False)
        >>> memory = estimate_rank_memory(request)
        >>> memory.copies, memory.tokens, memory.width  # 14,040 tokens (9 latent frames of 30 x 52), half a rank
        (2, 7020, 1536)
    """
    device = torch.device(request.device)
    dtype = resolve_dtype(request.dtype, device)
    tokens, width = _sequence(request)
    spec = request.spec
    share = tokens if spec.tp > 1 else math.ceil(tokens / spec.world_size)
    return RankMemory(
        parameters=_parameters(request, request.layers),
        copies=1 + len(request.presets) + len(request.ratios),
        element_size=dtype.itemsize,
        tokens=share * request.batch,
        width=width,
        host_build_only=device.type == "cuda",
    )


def check_rank_memory(request: ParallelRequest, available: int | None = None) -> RankMemory:
    """The estimate for `request` when its ranks fit `available` bytes (default: `available_memory()`) shared by the
    ranks on this host.

    Raises:
        NotEnoughMemory: they do not fit; the message names the estimate a rank, the memory available and the
            options, with values, that would fit.

    Example:
        >>> from tome_processors.bench.parallel import ParallelRequest, parse_parallel
        >>> request = ParallelRequest(parse_parallel("ulysses=2"), "wan", ("balanced",), (), 3, 1, 480, 832, 33,
        ...                           None, 1, 0, 1, "cpu", "float32", False)  # all 30 blocks: 12.68 GiB a rank
        >>> check_rank_memory(request, available=16 * GIB)
        Traceback (most recent call last):
        ...
        tome_processors.bench.rank_memory.NotEnoughMemory: Expected ... What would fit, each alone: --layers 16. ...
    """
    memory = estimate_rank_memory(request)
    available = available_memory() if available is None else available
    ranks = request.spec.world_size
    budget = available // ranks
    if memory.total_bytes <= budget:
        return memory
    raise NotEnoughMemory(
        f"Expected the {ranks} ranks of --parallel {request.spec} to fit this machine's memory, but a rank would take "
        f"about {_gib(memory.total_bytes)} and {_gib(available)} is available, {_gib(budget)} a rank: the operating "
        f"system would kill a rank. A rank holds {memory.describe()}. {_what_fits(request, memory, budget)} "
        "(--ignore-memory-estimate runs it anyway.)"
    )


def _what_fits(request: ParallelRequest, memory: RankMemory, budget: int) -> str:
    """The options that shrink the run to `budget` a rank, each alone, or together where none alone does."""
    counts: dict[int | None, int] = {request.layers: memory.parameters}

    def at(layers: int, copies: int = memory.copies) -> RankMemory:
        if layers not in counts:
            counts[layers] = _parameters(request, layers)
        return replace(memory, parameters=counts[layers], copies=copies)

    fits: list[str] = []
    layers = _most_layers(request, at, budget)
    if layers is not None:
        fits.append(f"--layers {layers}")
    size = _largest_size(request, memory, budget)
    if size is not None:
        fits.append(size)
    if memory.copies > 2 and replace(memory, copies=2).total_bytes <= budget:
        fits.append("one row beside the baseline (--presets balanced alone, no --ratios: 2 copies of the model)")
    if fits:
        fitting = "What would fit, each alone: " + "; ".join(fits) + "."
        if size is None and not memory.host_build_only:
            shrink = "--frames" if request.arch in VIDEO_ARCHITECTURES else "--resolution"
            fixed = memory.total_bytes - memory.activation_bytes
            fitting += f" Not {shrink} alone: the weights and the process take {_gib(fixed)} of it."
        return fitting
    smallest = at(1, copies=min(memory.copies, 2))
    rows = ", one row beside the baseline (--presets balanced, no --ratios)" if memory.copies > 2 else ""
    if smallest.total_bytes <= budget:
        return f"Nothing alone fits; together, --layers 1{rows} fits."
    size = _largest_size(request, smallest, budget)
    if size is not None:
        return f"Nothing alone fits; together, --layers 1{rows} and {size} fit."
    return f"Nothing fits: not even --layers 1{rows} at the smallest size."


def _most_layers(request: ParallelRequest, at: Callable[[int], RankMemory], budget: int) -> int | None:
    """The most blocks a block list (`--layers`) below the run's depth at which a rank fits, or None."""
    depth = _depth(request)
    low, high = 1, min(request.layers or depth, depth) - 1  # the run's own depth does not fit
    if high < low or at(low).total_bytes > budget:
        return None
    while low < high:  # at(low) fits
        middle = (low + high + 1) // 2
        if at(middle).total_bytes <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _depth(request: ParallelRequest) -> int:
    """The full model's deepest block list (`--layers` caps each)."""
    config = build_transformer(request.arch, quick=request.quick, layers=None, device="meta").config
    fields = ARCHS[request.arch].depth_fields if request.arch in ARCHS else _DEPTH_FIELDS
    return max(config[name] for name in fields if name in config)


def _largest_size(request: ParallelRequest, memory: RankMemory, budget: int) -> str | None:
    """`--frames F` (a video) or `--resolution R` (an image) below the run's at which a rank fits, or None: a video's
    tokens go with its latent frames, an image's with its pixels."""
    spare = budget - (memory.total_bytes - memory.activation_bytes)
    if spare <= 0 or memory.activation_bytes == 0:
        return None
    scale = spare / memory.activation_bytes  # of the run's tokens, below 1 where the run does not fit
    if request.arch in VIDEO_ARCHITECTURES:
        stride = VIDEO_STRIDES[request.arch][0]
        frames = request.frames or VIDEO_DEFAULTS[request.arch][2]
        fitting = math.floor(latent_frames(request.arch, frames) * scale)
        return f"--frames {1 + (fitting - 1) * stride}" if fitting >= 1 else None
    resolution = math.floor(request.resolution * math.sqrt(scale) / 16) * 16
    return f"--resolution {resolution}" if resolution >= 16 else None
