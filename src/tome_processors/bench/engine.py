"""The measuring engine of `tome-processors bench`: methods in, one row of numbers per method out.

A `Method` is anything that can be put on a model and taken off again (the baseline, this library at a
ratio, tomesd, a mode). `run_benchmark` measures every method on the same model and the same fixed
inputs, in one process:

1. A reference forward of the first method (the baseline) gives the reference output and records the
   input of every transformer block (`Recording`), for the overhead measurement.
2. Warm-up: every method runs `warmup` times. Each method's first output gives its fidelity, the
   relative L2 error `||out - out_ref|| / ||out_ref||`.
3. Rounds: each round runs every method once, in an order rotated by one place per round, so no
   method always runs first or right after the same neighbour, and the baseline again before every
   `baseline_every` methods and at the end, so that each method sits between two baseline runs.
   Right after its forward, a method's merge work alone (`Method.overhead`) is timed on the
   recorded block inputs.
4. Merging: the method's first forward (compiled: one eager forward of its copy) counts the tokens through the
   model's linear layers, so a row that merges or pools nothing in these forwards (its count is the baseline's)
   says so (`Row.merges`).
5. Inspection: one more forward per method, untimed, right after its first warm-up forward (after the
   rounds when compiled): its peak memory (the CUDA allocator's peak, or on CPU the peak resident set
   sampled by a background thread) and its host cost (`hostcost.py`: aten ops, host-sync ops, and on
   CUDA kernels and host syncs).

Speed-up is paired: the median over rounds of `baseline time / method time`, the baseline time being
the mean of the two baseline runs around the method, a few forwards apart. So drifts in machine
load (on a shared VM they come and go within a minute) mostly cancel out. The round whose ratio is that
median also gives the times shown beside it (`Row.pair_seconds`, `Row.pair_baseline_seconds`), so the
speed-up is the ratio of the two; the lowest and highest ratios of all rounds show the noise.

With `BenchSettings.compile`, each method is put on its own copy of the model that shares the weights
(`shared_weight_copy`), stays applied for the whole run and is compiled with `torch.compile`, the
baseline the same way; warm-up rounds repeat until a whole round compiles nothing, and `Row.compiles`
counts the compilations that still happened during the method's timed runs.

Example:
    >>> rows = run_benchmark(unet, methods, inputs.run, BenchSettings(rounds=3))  # doctest: +SKIP
    >>> rows[1].speedup  # doctest: +SKIP
    1.13
"""

from __future__ import annotations

import copy
import ctypes
import gc
import itertools
import math
import statistics
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psutil
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from tqdm.auto import tqdm

from ..arguments import argument
from ..config import ToMeConfig
from ..context import BlockState, ModelState
from ..families import find_family
from .hostcost import HostCost, measure_host_cost
from .meta import timed
from .profiling import ForwardProfile, profile_forward

__all__ = [
    "BenchSettings",
    "BlockInput",
    "Method",
    "Recording",
    "Row",
    "count_linear_tokens",
    "record_block_inputs",
    "relative_error",
    "run_benchmark",
    "shared_weight_copy",
]


class BlockInput(NamedTuple):
    """What one transformer block saw in the reference forward.

    Attributes:
        index: the block's position in the model family's block list (`Family.blocks`), as the
            library's `BlockState` numbers it.
        tokens: `(B, N, C)` the raw block input (a copy, in the block input's memory layout, which
            is channels-first in UNets: the matching reads it as it is).
        h, w: the block's token grid (`h * w == N`), or 0, 0 when it is not a grid of the latent.
        downsample: the level's downsample factor (1 at the latent resolution), 0 when not a grid.
        hidden: the same values, contiguous, like the normalised hidden states that the processor
            merges; one copy shared by every method's overhead replay.
    """

    index: int
    tokens: torch.Tensor
    h: int
    w: int
    downsample: int
    hidden: torch.Tensor


class Recording(NamedTuple):
    """The reference forward: its output and what the library's per-forward state was given.

    Attributes:
        output: the model's output.
        latent_hw: the token grid of the forward (a UNet's latent, a transformer's patch grid; a video's
            `(frames, h, w)`).
        timestep: the timestep as the family reads it from the model's arguments.
        blocks: every block call, in call order.
        needs_row_token: whether the family's merges record the rows' kept tokens (Flux's rotary
            embeddings), as a real forward's do.
    """

    output: Any
    latent_hw: tuple[int, ...] | None
    timestep: Any
    blocks: list[BlockInput]
    needs_row_token: bool = False


#: Puts a method on a model, or takes it off again (in place).
Apply = Callable[[torch.nn.Module], Any]


@dataclass
class Method:
    """One configuration to measure: how to put it on a model and take it off.

    Attributes:
        name: unique label of the row, e.g. `"ours r=0.5"`.
        family: the curve it belongs to in the plot, e.g. `"ours"` or `"tomesd"`.
        ratio: the merge ratio, or None where there is none (baseline, K/V pooling).
        apply: puts the method on a model (changes it in place).
        remove: takes it off again, leaving the baseline model.
        overhead: optional; given the reference `Recording`, returns a callable that does the method's
            own extra tensor work of one forward (matching, merge, unmerge, pooling) on those block inputs.
        settings: what to record about the method in the JSON (e.g. its `ToMeConfig` fields).

    Example:
        >>> from tome_processors import apply_tome, remove_tome
        >>> Method("ours r=0.5", "ours", 0.5, lambda u: apply_tome(u, ratio=0.5), remove_tome)  # doctest: +ELLIPSIS
        Method(name='ours r=0.5', ...)
    """

    name: str
    family: str
    ratio: float | None
    apply: Apply
    remove: Apply
    overhead: Callable[[Recording], Callable[[], Any]] | None = None
    settings: dict[str, Any] = field(default_factory=dict)


def with_tome_rows(alone: Method, tome_methods: Sequence[Method], family: str) -> list[Method]:
    """`alone` (another accelerator's row), then a row for each of `tome_methods` stacked on it, in `family`: ToMe put
    on first and taken off last, the settings of both recorded.

    Example:
        >>> nothing = Method("cache", "cache", None, lambda m: None, lambda m: None)
        >>> tome = Method("ours r=0.5", "ours", 0.5, lambda m: None, lambda m: None)
        >>> [(m.name, m.family) for m in with_tome_rows(nothing, [tome], "cache + ours")]
        [('cache', 'cache'), ('cache + ours r=0.5', 'cache + ours')]
    """
    rows = [alone]
    for tome in tome_methods:
        rows.append(
            Method(
                f"{alone.name} + {tome.name}",
                family,
                tome.ratio,
                _in_turn(tome.apply, alone.apply),
                _in_turn(alone.remove, tome.remove),
                settings={**alone.settings, **tome.settings},
            )
        )
    return rows


def _in_turn(first: Apply, second: Apply) -> Callable[[torch.nn.Module], None]:
    def run(model: torch.nn.Module) -> None:
        first(model)
        second(model)

    return run


@dataclass
class Row:
    """The measurements of one method.

    Attributes:
        name, family, ratio: from the `Method`.
        seconds: median time of one forward over all its timed runs.
        speedup: median over rounds of the baseline's time (the mean of the two baseline runs
            around this method) divided by this method's (for an even number of rounds, the lower of
            the two middle ratios, so that it is one round's ratio).
        pair_seconds, pair_baseline_seconds: this method's time and its paired baseline time in the
            round whose ratio is `speedup`: `speedup == pair_baseline_seconds / pair_seconds`. For the
            baseline, both are `seconds`.
        speedup_min, speedup_max: the lowest and highest ratio over the rounds (the run-to-run noise).
        rel_error: `||out - out_ref|| / ||out_ref||` of the model output on the same inputs.
        peak_memory_mib: CUDA allocator peak, or peak resident set on CPU, during one forward.
        memory_before_mib: the same quantity just before that forward (weights, inputs, caches).
        overhead_seconds: median time of the method's own merge work per forward (None if it has none).
        overhead_share: median over rounds of overhead time / the paired baseline forward time.
        aten_ops: aten operators dispatched in one forward (views included).
        sync_ops: of those, the ones that make the host wait for the device or copy Python data to it
            (`hostcost.HOST_SYNC_OPS`, boolean-mask indexing).
        sync_op_names: `{op name: count}` of those.
        cuda_kernels: CUDA kernels launched in one forward (CUDA only).
        cuda_syncs: host-device synchronisations in one forward, from CUDA's sync debug mode (CUDA only).
        compiles: with `BenchSettings.compile`, dynamo compilations during this method's timed runs
            (0 when the compiled graphs were reused); None without compilation.
        times: the forward time of every timed run, in seconds (one per round; the baseline runs
            several times per round); a run of `forwards_per_run` forwards counts their mean.
        forwards_per_run: back-to-back forwards in each timed run (`BenchSettings.min_run_seconds`).
        overhead_times: the overhead time of every round, in seconds.
        inner_seconds, inner_speedup, inner_times: the same as `seconds`, `speedup` and `times` for the
            second measure of each timed run (`run_benchmark`'s `inner_seconds`), paired the same way;
            None and empty without one.
        linear_tokens: tokens (rows) the model's linear layers got in one forward with the method on, counted
            in its first forward: merging or pooling anywhere sends fewer than the baseline does.
        merges: whether the method merged or pooled anything in these forwards (`linear_tokens` below the
            baseline's); None for the baseline and where nothing was counted.
        idle: why a row that merges nothing in these forwards (`merges` False) merges nothing, as the report
            says it; set by the report's caller (None elsewhere).
        extra: further metrics from `extra_metrics(method)` (empty unless given).
        settings: from the `Method`.
        profile: with `BenchSettings.profile`, one forward's time by op; else None.
    """

    name: str
    family: str
    ratio: float | None
    seconds: float
    speedup: float
    rel_error: float
    peak_memory_mib: float | None = None
    memory_before_mib: float | None = None
    overhead_seconds: float | None = None
    overhead_share: float | None = None
    aten_ops: int | None = None
    sync_ops: int | None = None
    sync_op_names: dict[str, int] = field(default_factory=dict)
    cuda_kernels: int | None = None
    cuda_syncs: int | None = None
    compiles: int | None = None
    times: list[float] = field(default_factory=list)
    overhead_times: list[float] = field(default_factory=list)
    inner_seconds: float | None = None
    inner_speedup: float | None = None
    inner_times: list[float] = field(default_factory=list)
    pair_seconds: float | None = None
    pair_baseline_seconds: float | None = None
    forwards_per_run: int = 1
    speedup_min: float | None = None
    speedup_max: float | None = None
    linear_tokens: int | None = None
    merges: bool | None = None
    idle: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    profile: ForwardProfile | None = None


@dataclass
class BenchSettings:
    """How to measure.

    Attributes:
        rounds: timed rounds (each runs every method once).
        warmup: untimed forwards per method before the rounds (at least 1: fidelity comes from it).
        measure_memory: measure peak memory in the inspection forward.
        host_cost: count the host cost (aten ops, syncs, CUDA kernels) in the inspection forward.
        profile: time one more forward per method op by op (`profiling.profile_forward`, `Row.profile`).
        memory_interval: seconds between resident-set samples on CPU.
        progress: show a tqdm progress bar (with the time left).
        baseline_every: in each timed round, run the baseline again after every this many methods
            (and at the end); each method is paired with the mean of the two baseline runs around it.
        compile: None (eager), or a `torch.compile` mode (`"default"`, `"reduce-overhead"`,
            `"max-autotune-no-cudagraphs"`, ...) applied to the baseline and to every method alike.
        compile_backend: the `torch.compile` backend (`"inductor"`; `"eager"` or `"aot_eager"` trace
            without generating code, to check graph breaks and recompiles cheaply).
        max_compile_warmup: with `compile`, at most this many warm-up rounds in all while a round
            still compiles something.
        keep_applied: eager, too: each method stays applied on its own shared-weight copy of the model for the
            whole run, so every timed forward is a later one after applying it, as in a generation's steps
            (otherwise the method goes on right before its forward and off right after it, and each timed forward
            is its first after applying: on a model of a few milliseconds per forward that shows). Needs a model
            (`nn.Module`) and methods that act on the model they are given.
        min_run_seconds: a timed run repeats the forward back to back, the same number of times for every method
            (at most `MAX_FORWARDS_PER_RUN`), until it lasts at least this long by the baseline's time, and counts
            their mean: a forward of a few milliseconds, timed alone, varies by more than the few percent
            between methods. 0 (the default): one forward per run. Not with `inner_seconds`.
    """

    rounds: int = 3
    warmup: int = 1
    measure_memory: bool = True
    host_cost: bool = True
    profile: bool = False
    memory_interval: float = 0.001
    progress: bool = True
    baseline_every: int = 3
    compile: str | None = None
    compile_backend: str = "inductor"
    max_compile_warmup: int = 5
    keep_applied: bool = False
    min_run_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.min_run_seconds, (int, float)) and 0 <= self.min_run_seconds < float("inf")):
            raise ValueError(f"Expected min_run_seconds to be a number >= 0, but got {self.min_run_seconds!r}.")
        if not (isinstance(self.baseline_every, int) and self.baseline_every >= 1):
            raise ValueError(f"Expected baseline_every to be an integer >= 1, but got {self.baseline_every!r}.")
        if not (isinstance(self.rounds, int) and self.rounds >= 1):
            raise ValueError(f"Expected rounds to be an integer >= 1, but got {self.rounds!r}.")
        if not (isinstance(self.warmup, int) and self.warmup >= 1):
            raise ValueError(f"Expected warmup to be an integer >= 1, but got {self.warmup!r}.")
        if not (isinstance(self.max_compile_warmup, int) and self.max_compile_warmup >= self.warmup):
            raise ValueError(
                f"Expected max_compile_warmup to be an integer >= warmup ({self.warmup}), "
                f"but got {self.max_compile_warmup!r}."
            )


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """`||out - reference|| / ||reference||` in float64.

    Example:
        >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]))
        1.3333333333333333
    """
    reference = reference.double()
    return float((out.double() - reference).norm() / reference.norm().clamp_min(1e-300))


def record_block_inputs(model: torch.nn.Module, forward: Callable[[], Any]) -> Recording:
    """Run `forward()` once and record the token grid, the timestep and the raw input of every block.

    Which blocks count, the token grid and the timestep come from the model's family
    (`tome_processors.families`); each block's grid from the library's `BlockState.grid`.
    """
    family = find_family(model)  # UNet: the latent; diffusion transformers: the patch grid
    state = ModelState(config=ToMeConfig())
    seen: list[BlockInput] = []
    forward_args: list[tuple[tuple[int, int], Any]] = []

    def model_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        grid = family.token_grid(module, args, kwargs)
        if grid is not None:
            timestep = family.timestep(args, kwargs)
            forward_args.append((grid, timestep))
            state.begin(grid[-2:], timestep, None, frames=grid[0] if len(grid) == 3 else 1)  # a video's: (frames, h, w)

    def block_hook(index: int, args: tuple, kwargs: dict) -> None:
        tokens = argument(args, kwargs, 0, "hidden_states")
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3 or not forward_args:
            return
        grid_tokens = math.prod(forward_args[-1][0])  # (h, w), or a video's (frames, h, w)
        tokens = sites[index].metric(tokens, grid_tokens)  # the grid's tokens where the input holds others too
        grid = BlockState(state, index).grid(tokens.shape[1])
        h, w, downsample = (grid.h, grid.w, grid.downsample) if grid is not None else (0, 0, 0)
        copy_ = tokens.detach().clone()
        seen.append(BlockInput(index, copy_, h, w, downsample, copy_.contiguous()))

    handles = []
    if family is not None:
        handles.append(model.register_forward_pre_hook(model_hook, with_kwargs=True))
        sites = family.blocks(model)
        for index, site in enumerate(sites):
            hook = _bind_index(block_hook, index)
            handles.append(site.module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        out = forward()
    finally:
        for handle in handles:
            handle.remove()
    latent_hw, timestep = forward_args[-1] if forward_args else (None, None)
    return Recording(out, latent_hw, timestep, seen, family is not None and family.needs_row_token)


def count_linear_tokens(model: torch.nn.Module, run: Callable[[], Any]) -> tuple[Any, int]:
    """`run()`'s output and the tokens (rows: every dimension but the last) that `model`'s linear layers got in it.

    A method that merges tokens or pools keys and values anywhere sends fewer through the projections than the
    model without it does: the count tells from a real forward whether a method merged at all.

    Example:
        >>> layer = torch.nn.Linear(4, 2)
        >>> count_linear_tokens(layer, lambda: layer(torch.ones(3, 5, 4)))[1]
        15
    """
    total = 0

    def count(module: torch.nn.Module, args: tuple) -> None:
        nonlocal total
        if args and isinstance(args[0], torch.Tensor) and args[0].ndim > 0:
            total += args[0].numel() // max(args[0].shape[-1], 1)

    handles = [m.register_forward_pre_hook(count) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        out = run()
    finally:
        for handle in handles:
            handle.remove()
    return out, total


def _bind_index(hook: Callable[[int, tuple, dict], None], index: int) -> Callable[..., None]:
    def bound(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hook(index, args, kwargs)

    return bound


def shared_weight_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters and buffers are the original's tensors (no memory for weights).

    Each copy can carry its own method (processors, hooks, patched classes) while all share one set of
    weights: the compiled bench keeps every method applied on its own copy, so no compiled graph is
    invalidated by putting a method on or taking it off.

    Example:
        >>> base = torch.nn.Linear(2, 2)
        >>> shared_weight_copy(base).weight is base.weight
        True
    """
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


class _ResidentSetSampler:
    """Samples the process's resident set size from a background thread; `peak` in bytes."""

    def __init__(self, interval: float) -> None:
        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.before = self._process.memory_info().rss
        self.peak = self.before

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self._interval)

    def __enter__(self) -> _ResidentSetSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def _release_cpu_memory() -> None:
    """Return freed heap memory to the OS (glibc), so each method starts from the same resident set."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextmanager
def _peak_memory(device: torch.device, interval: float, enabled: bool) -> Iterator[list[float | None]]:
    """Measures the peak memory of the enclosed forward: yields `[peak, before]` in MiB, filled on exit."""
    result: list[float | None] = [None, None]
    mib = 1024.0**2
    if not enabled:
        yield result
    elif device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result[:] = [torch.cuda.max_memory_allocated(device) / mib, before / mib]
    else:
        _release_cpu_memory()
        with _ResidentSetSampler(interval) as sampler:
            yield result
        result[:] = [sampler.peak / mib, sampler.before / mib]


def _schedule(n: int, round_index: int, baseline_every: int, timed: bool) -> list[int]:
    """The order of method indices in one round (0 is the baseline).

    Warm-up: every method once, rotated. Timed: the other methods rotated by one place per round,
    in groups of `baseline_every`, with the baseline before each group and after the last.

    Example:
        >>> _schedule(6, 1, 2, timed=True)
        [0, 2, 3, 0, 4, 5, 0, 1, 0]
    """
    if not timed:
        shift = round_index % n
        return list(range(shift, n)) + list(range(shift))
    others = list(range(1, n))
    if not others:
        return [0]
    shift = round_index % len(others)
    others = others[shift:] + others[:shift]
    order = [0]
    for start in range(0, len(others), baseline_every):
        order += [*others[start : start + baseline_every], 0]
    return order


def pair_with_baseline(runs: Sequence[tuple[int, float]], n: int) -> list[tuple[list[float], list[float]]]:
    """Per method of `n`: its times in one round and, for each, the baseline time it is paired with.

    `runs` are one round's `(method index, seconds)` in the order they ran: the baseline (index 0) before
    every group of methods and after the last. Each method is paired with the mean of the two baseline runs
    around its group; each baseline run with itself.

    Example:
        >>> pair_with_baseline([(0, 2.0), (1, 1.0), (2, 3.0), (0, 4.0)], 3)
        [([2.0, 4.0], [2.0, 4.0]), ([1.0], [3.0]), ([3.0], [3.0])]
    """
    paired: list[tuple[list[float], list[float]]] = [([], []) for _ in range(n)]
    pending: list[tuple[int, float]] = []
    previous = 0.0
    for i, seconds in runs:
        if i != 0:
            pending.append((i, seconds))
            continue
        paired[0][0].append(seconds)
        paired[0][1].append(seconds)
        for j, method_seconds in pending:
            paired[j][0].append(method_seconds)
            paired[j][1].append((previous + seconds) / 2)
        pending, previous = [], seconds
    if pending:
        raise ValueError(f"Expected the round to end with the baseline (index 0), but got {[i for i, _ in runs]}.")
    return paired


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _compilations() -> int:
    """Frames dynamo has compiled in this process so far."""
    return int(counters["stats"]["unique_graphs"])


class _Models:
    """The model each method runs on.

    Eager: one model; a method is applied right before its forward and removed right after it. Compiled, or with
    `keep_applied`: each method stays applied on its own shared-weight copy (compiled once, when compiled).
    """

    def __init__(self, model: torch.nn.Module, methods: Sequence[Method], settings: BenchSettings) -> None:
        self.model = model
        self.methods = methods
        self.applied: list[torch.nn.Module] = []
        self._copies: list[torch.nn.Module] = []
        if settings.compile is None and not settings.keep_applied:
            return
        try:
            for method in methods:
                copy_ = shared_weight_copy(model)
                self._copies.append(copy_)
                method.apply(copy_)
                if settings.compile is None:
                    self.applied.append(copy_)
                    continue
                mode = None if settings.compile == "default" else settings.compile
                self.applied.append(torch.compile(copy_, mode=mode, backend=settings.compile_backend))
        except BaseException:
            self.close()
            raise

    @contextmanager
    def eager(self, i: int) -> Iterator[torch.nn.Module]:
        """The model with method `i` on, not compiled (its copy, or the model it goes on and off)."""
        if self._copies:
            yield self._copies[i]
            return
        with self.use(i) as model:
            yield model

    @contextmanager
    def use(self, i: int) -> Iterator[torch.nn.Module]:
        if self.applied:  # compiled copies, or eager ones with `keep_applied`
            yield self.applied[i]
            return
        self.methods[i].apply(self.model)
        try:
            yield self.model
        finally:
            self.methods[i].remove(self.model)

    def close(self) -> None:
        for method, copy_ in zip(self.methods, self._copies, strict=False):
            method.remove(copy_)
        self._copies.clear()
        self.applied.clear()


@contextmanager
def _dynamo_limits(methods: int, enabled: bool) -> Iterator[None]:
    """Room in dynamo's per-function cache for one compiled graph per method (the default keeps 8)."""
    if not enabled:
        yield
        return
    limit = max(8, 2 * methods)
    # torch >= 2.6 names them recompile_limit; older releases cache_size_limit.
    old = not hasattr(torch._dynamo.config, "recompile_limit")
    names = (
        ("cache_size_limit", "accumulated_cache_size_limit")
        if old
        else ("recompile_limit", "accumulated_recompile_limit")
    )
    with torch._dynamo.config.patch({names[0]: limit, names[1]: max(256, 8 * limit)}):
        yield


def run_benchmark(
    model: torch.nn.Module,
    methods: Sequence[Method],
    forward: Callable[[torch.nn.Module], torch.Tensor],
    settings: BenchSettings | None = None,
    extra_metrics: Callable[[Method], dict[str, Any]] | None = None,
    inner_seconds: Callable[[], float] | None = None,
) -> list[Row]:
    """Measure every method on `model` with the same `forward(model)` (fixed inputs); one `Row` per method.

    Args:
        model: the model the methods are put on; it must be in its baseline state.
        methods: the first one is the reference (the baseline): its output is the fidelity reference
            and its times the speed-up's denominator.
        forward: runs one forward of the model it is given on fixed inputs and returns the output tensor.
        settings: rounds, warm-up, memory, host cost, compilation.
        extra_metrics: optional; called once per method after the measurements (with the method not
            applied; it may apply it itself, e.g. to a pipeline) and its dict is stored in `Row.extra`
            and shown as extra columns.
        inner_seconds: optional; called right after every timed forward, it returns a second time of that
            run (the denoiser's time per step inside a whole generation, say), which is paired with the
            baseline exactly as the forward's own time is (`Row.inner_seconds`, `Row.inner_speedup`).

    Example:
        >>> rows = run_benchmark(unet, [baseline, ours], inputs.run)  # doctest: +SKIP
    """
    settings = settings or BenchSettings()
    if not methods:
        raise ValueError("Expected at least one method (the baseline first), but got none.")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"Expected unique method names, but got {names}.")
    n = len(methods)

    schedules = [_schedule(n, r, settings.baseline_every, False) for r in range(settings.warmup)]
    schedules += [_schedule(n, r, settings.baseline_every, True) for r in range(settings.rounds)]
    total = 1 + sum(len(order) for order in schedules) + (n if extra_metrics is not None else 0)
    if _inspects(settings):
        # One inspection forward per method. Eager, it follows the method's first warm-up forward, which fills
        # the caches that every later forward finds; compiled, it comes after the rounds (the copies are warm).
        total += n
    bar = tqdm(total=total, unit="fwd", disable=not settings.progress, leave=False)

    try:
        bar.set_description("reference")
        methods[0].apply(model)
        try:
            recording = record_block_inputs(model, lambda: forward(model))
        finally:
            methods[0].remove(model)
        bar.update(1)
        reference = recording.output.detach().clone()
        recording = recording._replace(output=None)
        overhead_calls = [m.overhead(recording) if m.overhead is not None else None for m in methods]
        with _dynamo_limits(n, settings.compile is not None):
            models = _Models(model, methods, settings)
            try:
                measured = _measure(
                    models, methods, forward, reference, overhead_calls, schedules, settings, bar, inner_seconds
                )
            finally:
                models.close()
        extra: list[dict[str, Any]] = []
        for method in methods:
            bar.set_description(f"extra metrics: {method.name}")
            extra.append(dict(extra_metrics(method)) if extra_metrics is not None else {})
            bar.update(1 if extra_metrics is not None else 0)
    finally:
        bar.close()
    return [_row(method, measured, i, extra[i]) for i, method in enumerate(methods)]


#: `BenchSettings.min_run_seconds` repeats a forward at most this many times per timed run.
MAX_FORWARDS_PER_RUN = 50


@dataclass
class _Measured:
    errors: list[float | None]
    times: list[list[float]]
    paired_base: list[list[float]]
    inner_times: list[list[float]]
    inner_paired_base: list[list[float]]
    overhead_times: list[list[float]]
    compiles: list[int | None]
    memory: list[tuple[float | None, float | None]]
    host: list[HostCost | None]
    profiles: list[ForwardProfile | None]
    linear_tokens: list[int | None]
    forwards_per_run: int = 1


def _measure(
    models: _Models,
    methods: Sequence[Method],
    forward: Callable[[torch.nn.Module], torch.Tensor],
    reference: torch.Tensor,
    overhead_calls: Sequence[Callable[[], Any] | None],
    schedules: list[list[int]],
    settings: BenchSettings,
    bar: Any,
    inner_seconds: Callable[[], float] | None,
) -> _Measured:
    n = len(methods)
    device = next(models.model.parameters()).device
    compiled = settings.compile is not None
    m = _Measured(
        errors=[None] * n,
        times=[[] for _ in range(n)],
        paired_base=[[] for _ in range(n)],
        inner_times=[[] for _ in range(n)],
        inner_paired_base=[[] for _ in range(n)],
        overhead_times=[[] for _ in range(n)],
        compiles=[0 if compiled else None] * n,
        memory=[(None, None)] * n,
        host=[None] * n,
        profiles=[None] * n,
        linear_tokens=[None] * n,
    )

    def record_error(i: int, out: torch.Tensor) -> None:
        if m.errors[i] is None:
            m.errors[i] = relative_error(out, reference)

    def run(i: int, in_round: bool) -> float:
        before = _compilations() if compiled else 0
        repeats = m.forwards_per_run if in_round else 1
        with models.use(i) as current:
            out, seconds = timed(lambda: _repeated(forward, current, repeats), device)
            seconds /= repeats
        if compiled and in_round:
            m.compiles[i] += _compilations() - before
        record_error(i, out)
        del out
        if in_round and overhead_calls[i] is not None:
            m.overhead_times[i].append(timed(overhead_calls[i], device)[1])
        bar.update(1)
        return seconds

    def inspect(i: int, current: torch.nn.Module) -> None:
        # Peak memory and host cost of a forward that finds the method's caches (per-grid tables) filled, as
        # every forward but the first after applying it does.
        with _peak_memory(device, settings.memory_interval, settings.measure_memory) as memory:
            if settings.host_cost:
                out, m.host[i] = measure_host_cost(lambda: forward(current), device)
            else:
                out = forward(current)
            del out
        m.memory[i] = (memory[0], memory[1])
        if settings.profile:  # a forward of its own: the profiler's work stays out of the memory and the counts
            out, m.profiles[i] = profile_forward(lambda: forward(current), device)
            del out
        bar.update(1)

    if compiled:
        # The eager merges that the rounds time for the overhead column fill the library's per-shape caches; made
        # before the warm-up, the compiled graphs find them filled, instead of a graph traced before them being
        # traced again in a timed round.
        for call in overhead_calls:
            if call is not None:
                call()
    warmups = settings.warmup
    inspect_in_warmup = _inspects(settings) and not compiled
    for round_index, order in enumerate(schedules[:warmups]):
        bar.set_description(f"warm-up {round_index + 1}")
        for i in order:
            if round_index == 0 and not compiled:  # the first forward: its error and its tokens
                with models.use(i) as current:
                    out, m.linear_tokens[i] = count_linear_tokens(current, lambda current=current: forward(current))
                    record_error(i, out)
                    del out
                    bar.update(1)
                    if inspect_in_warmup:
                        inspect(i, current)
            else:
                run(i, in_round=False)
    # Compiled: warm up again until a whole round compiles nothing (guards settling), within the limit.
    extra_round = warmups
    while compiled and extra_round < settings.max_compile_warmup:
        before = _compilations()
        bar.set_description(f"warm-up {extra_round + 1} (compiling)")
        bar.total += n
        bar.refresh()
        for i in _schedule(n, extra_round, settings.baseline_every, False):
            run(i, in_round=False)
        extra_round += 1
        if _compilations() == before:
            break

    if settings.min_run_seconds > 0 and inner_seconds is None:
        with models.use(0) as current:
            seconds = timed(lambda: forward(current), device)[1]
        m.forwards_per_run = min(MAX_FORWARDS_PER_RUN, max(1, math.ceil(settings.min_run_seconds / seconds)))

    for round_index, order in enumerate(schedules[warmups:]):
        bar.set_description(f"round {round_index + 1}")
        # Timed: baseline, a few methods, baseline, ... (the schedule starts and ends with the baseline).
        runs, inner_runs = [], []
        for i in order:
            runs.append((i, run(i, in_round=True)))
            if inner_seconds is not None:
                inner_runs.append((i, inner_seconds()))
        for measure, paired, measured in (
            (m.times, m.paired_base, runs),
            (m.inner_times, m.inner_paired_base, inner_runs),
        ):
            for i, (seconds, base) in enumerate(pair_with_baseline(measured, n)):
                measure[i] += seconds
                paired[i] += base

    if _inspects(settings) and compiled:
        for i, method in enumerate(methods):
            bar.set_description(f"inspection: {method.name}")
            with models.use(i) as current:
                inspect(i, current)
    if compiled:  # hooks in a compiled graph would recompile it: one eager forward of each method's copy
        bar.total += n
        for i, method in enumerate(methods):
            bar.set_description(f"tokens: {method.name}")
            with models.eager(i) as current:
                m.linear_tokens[i] = count_linear_tokens(current, lambda current=current: forward(current))[1]
            bar.update(1)
    return m


def _repeated(forward: Callable[[torch.nn.Module], torch.Tensor], model: torch.nn.Module, times: int) -> torch.Tensor:
    """`forward(model)` `times` times back to back; the last output."""
    for _ in range(times - 1):
        forward(model)
    return forward(model)


def _inspects(settings: BenchSettings) -> bool:
    """Whether a run has inspection forwards (peak memory, host cost, profile)."""
    return settings.measure_memory or settings.host_cost or settings.profile


def _median_round(ratios: Sequence[float]) -> int:
    """The index of the median ratio (the lower middle one for an even count).

    Example:
        >>> _median_round([1.3, 0.9, 1.1, 1.0])
        3
    """
    order = sorted(range(len(ratios)), key=ratios.__getitem__)
    return order[(len(order) - 1) // 2]


def _row(method: Method, m: _Measured, i: int, extra: dict[str, Any]) -> Row:
    speedups = [b / t for b, t in zip(m.paired_base[i], m.times[i], strict=True)]
    inner_speedups = [b / t for b, t in zip(m.inner_paired_base[i], m.inner_times[i], strict=True)]
    shares = [o / b for o, b in zip(m.overhead_times[i], m.paired_base[i], strict=False)]
    host = m.host[i]
    seconds = statistics.median(m.times[i])
    tokens, baseline_tokens = m.linear_tokens[i], m.linear_tokens[0]
    merges = None if i == 0 or tokens is None or baseline_tokens is None else tokens < baseline_tokens
    if i == 0:  # the baseline, paired with itself
        speedup, pair_seconds, pair_base = 1.0, seconds, seconds
    else:
        k = _median_round(speedups)
        speedup, pair_seconds, pair_base = speedups[k], m.times[i][k], m.paired_base[i][k]
    return Row(
        name=method.name,
        family=method.family,
        ratio=method.ratio,
        seconds=seconds,
        speedup=speedup,
        rel_error=float(m.errors[i]),
        peak_memory_mib=m.memory[i][0],
        memory_before_mib=m.memory[i][1],
        overhead_seconds=_median(m.overhead_times[i]),
        overhead_share=_median(shares),
        aten_ops=None if host is None else host.aten_ops,
        sync_ops=None if host is None else host.sync_ops,
        sync_op_names={} if host is None else dict(host.sync_op_names),
        cuda_kernels=None if host is None else host.cuda_kernels,
        cuda_syncs=None if host is None else host.cuda_syncs,
        compiles=m.compiles[i],
        times=m.times[i],
        overhead_times=m.overhead_times[i],
        inner_seconds=_median(m.inner_times[i]),
        inner_speedup=_median(inner_speedups),
        inner_times=m.inner_times[i],
        pair_seconds=pair_seconds,
        pair_baseline_seconds=pair_base,
        speedup_min=None if i == 0 else min(speedups),
        speedup_max=None if i == 0 else max(speedups),
        linear_tokens=tokens,
        merges=merges,
        extra=extra,
        settings=dict(method.settings),
        profile=m.profiles[i],
        forwards_per_run=m.forwards_per_run,
    )
