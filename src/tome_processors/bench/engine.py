"""The measuring engine of `tome-processors bench`: methods in, one row of numbers per method out.

A `Method` is anything that can be put on a UNet and taken off again (the baseline, this library at a
ratio, tomesd, a mode). `run_benchmark` measures every method on the same model and the same fixed
inputs, in one process:

1. A reference forward of the first method (the baseline) gives the reference output and records the
   input of every spatial transformer block (`BlockInput`), for the overhead measurement.
2. Warm-up: every method runs `warmup` times. Each method's first output gives its fidelity, the
   relative L2 error `||out - out_ref|| / ||out_ref||`.
3. Rounds: each round runs every method once, in an order rotated by one place per round, so no
   method always runs first or right after the same neighbour, and the baseline again before every
   `baseline_every` methods and at the end, so that each method sits between two baseline runs.
   Right after its forward, a method's merge work alone (`Method.overhead`) is timed on the
   recorded block inputs.
4. Memory: one more forward per method, untimed: the CUDA allocator's peak, or on CPU the peak
   resident set sampled by a background thread (kept out of the timed rounds).

Speed-up is paired: the median over rounds of `baseline time / method time`, the baseline time being
the mean of the two baseline runs around the method, a few forwards apart. So drifts in machine
load (on a shared VM they come and go within a minute) mostly cancel out.

Example:
    >>> rows = run_benchmark(unet, methods, lambda: inputs.run(unet), BenchSettings(rounds=3))  # doctest: +SKIP
    >>> rows[1].speedup  # doctest: +SKIP
    1.13
"""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .families import find_family
from .merge import level_downsample

__all__ = ["BenchSettings", "BlockInput", "Method", "Row", "record_block_inputs", "relative_error", "run_benchmark"]


class BlockInput(NamedTuple):
    """What one spatial transformer block saw in the reference forward.

    Attributes:
        tokens: `(B, N, C)` the raw block input (a copy, in the block input's memory layout, which
            is channels-first in UNets: the matching reads it as it is).
        h, w: the block's token grid (`h * w == N`), or 0, 0 when it is not a grid of the latent.
        downsample: the level's downsample factor (1 at the latent resolution).
        hidden: the same values, contiguous, like the normalised hidden states that the processor
            merges; one copy shared by every method's overhead replay. None: use `tokens`.
    """

    tokens: torch.Tensor
    h: int
    w: int
    downsample: int
    hidden: torch.Tensor | None = None


@dataclass
class Method:
    """One configuration to measure: how to put it on a UNet and take it off.

    Attributes:
        name: unique label of the row, e.g. `"ours r=0.5"`.
        family: the curve it belongs to in the plot, e.g. `"ours"` or `"tomesd"`.
        ratio: the merge ratio, or None where there is none (baseline, K/V pooling).
        apply: puts the method on a UNet (changes it in place).
        remove: takes it off again, leaving the baseline UNet.
        overhead: optional; given the recorded block inputs, returns a callable that does the method's own
            extra tensor work of one forward (matching, merge, unmerge, pooling) on tensors of those shapes.
        settings: what to record about the method in the JSON (e.g. its `ToMeConfig` fields).

    Example:
        >>> from tome_processors import apply_tome, remove_tome
        >>> Method("ours r=0.5", "ours", 0.5, lambda u: apply_tome(u, ratio=0.5), remove_tome)  # doctest: +ELLIPSIS
        Method(name='ours r=0.5', ...)
    """

    name: str
    family: str
    ratio: float | None
    apply: Callable[[torch.nn.Module], Any]
    remove: Callable[[torch.nn.Module], Any]
    overhead: Callable[[Sequence[BlockInput]], Callable[[], Any]] | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    """The measurements of one method.

    Attributes:
        name, family, ratio: from the `Method`.
        seconds: median time of one UNet forward over the rounds.
        speedup: median over rounds of the baseline's time (the mean of the two baseline runs
            around this method) divided by this method's.
        rel_error: `||out - out_ref|| / ||out_ref||` of the UNet output on the same inputs.
        peak_memory_mib: CUDA allocator peak, or peak resident set on CPU, during one forward.
        memory_before_mib: the same quantity just before that forward (weights, inputs, caches).
        overhead_seconds: median time of the method's own merge work per forward (None if it has none).
        overhead_share: median over rounds of overhead time / the paired baseline forward time.
        times: the forward time of every timed run, in seconds (one per round; the baseline runs
            several times per round).
        overhead_times: the overhead time of every round, in seconds.
        extra: further metrics from `extra_metrics(method)` (empty unless given).
        settings: from the `Method`.
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
    times: list[float] = field(default_factory=list)
    overhead_times: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchSettings:
    """How to measure.

    Attributes:
        rounds: timed rounds (each runs every method once).
        warmup: untimed forwards per method before the rounds (at least 1: fidelity comes from it).
        measure_memory: run the extra untimed forward per method that measures peak memory.
        memory_interval: seconds between resident-set samples on CPU.
        progress: show a tqdm progress bar.
        baseline_every: in each timed round, run the baseline again after every this many methods
            (and at the end); each method is paired with the mean of the two baseline runs around it.
    """

    rounds: int = 5
    warmup: int = 1
    measure_memory: bool = True
    memory_interval: float = 0.001
    progress: bool = True
    baseline_every: int = 3

    def __post_init__(self) -> None:
        if not (isinstance(self.baseline_every, int) and self.baseline_every >= 1):
            raise ValueError(f"Expected baseline_every to be an integer >= 1, but got {self.baseline_every!r}.")
        if not (isinstance(self.rounds, int) and self.rounds >= 1):
            raise ValueError(f"Expected rounds to be an integer >= 1, but got {self.rounds!r}.")
        if not (isinstance(self.warmup, int) and self.warmup >= 1):
            raise ValueError(f"Expected warmup to be an integer >= 1, but got {self.warmup!r}.")


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """`||out - reference|| / ||reference||` in float64.

    Example:
        >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]))
        1.3333333333333333
    """
    reference = reference.double()
    return float((out.double() - reference).norm() / reference.norm().clamp_min(1e-300))


def record_block_inputs(unet: torch.nn.Module, forward: Callable[[], Any]) -> tuple[Any, list[BlockInput]]:
    """Run `forward()` once and record the raw input of every spatial transformer block.

    Returns:
        `(output of forward, [BlockInput per block call, in call order])`.
    """
    latent: list[tuple[int, int]] = []
    seen: list[BlockInput] = []
    family = find_family(unet)  # UNet: the latent; diffusion transformers: the patch grid

    def model_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        grid = family.token_grid(module, args, kwargs) if family is not None else None
        if grid is not None:
            latent.append(grid)

    def block_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3 or not latent:
            return
        height, width = latent[-1]
        num_tokens = tokens.shape[1]
        downsample = level_downsample(height * width, num_tokens)
        h, w = math.ceil(height / downsample), math.ceil(width / downsample)
        if h * w != num_tokens:
            h = w = 0
        copy = tokens.detach().clone()
        seen.append(BlockInput(copy, h, w, downsample, copy.contiguous()))

    handles = [unet.register_forward_pre_hook(model_hook, with_kwargs=True)]
    blocks = [site.module for site in family.blocks(unet)] if family is not None else []
    handles += [b.register_forward_pre_hook(block_hook, with_kwargs=True) for b in blocks]
    try:
        out = forward()
    finally:
        for handle in handles:
            handle.remove()
    return out, seen


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _timed(call: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _synchronize(device)
    start = time.perf_counter()
    out = call()
    _synchronize(device)
    return out, time.perf_counter() - start


class _ResidentSetSampler:
    """Samples the process's resident set size from a background thread; `peak` in bytes."""

    def __init__(self, interval: float) -> None:
        import psutil  # noqa: PLC0415

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
        import ctypes  # noqa: PLC0415

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_memory(forward: Callable[[], Any], device: torch.device, interval: float) -> tuple[float, float]:
    """(peak, before) in MiB during one `forward()`."""
    mib = 1024.0**2
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = forward()
        torch.cuda.synchronize(device)
        del out
        return torch.cuda.max_memory_allocated(device) / mib, before / mib
    _release_cpu_memory()
    with _ResidentSetSampler(interval) as sampler:
        out = forward()
        del out
    return sampler.peak / mib, sampler.before / mib


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


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def run_benchmark(
    unet: torch.nn.Module,
    methods: Sequence[Method],
    forward: Callable[[], torch.Tensor],
    settings: BenchSettings | None = None,
    extra_metrics: Callable[[Method], dict[str, Any]] | None = None,
) -> list[Row]:
    """Measure every method on `unet` with the same `forward()` (fixed inputs); one `Row` per method.

    Args:
        unet: the model the methods are put on; it must be in its baseline state.
        methods: the first one is the reference (the baseline): its output is the fidelity reference
            and its times the speed-up's denominator.
        forward: runs one forward of `unet` on fixed inputs and returns the output tensor.
        settings: rounds, warm-up, memory.
        extra_metrics: optional; called once per method after the measurements (with the method not
            applied; it may apply it itself, e.g. to a pipeline) and its dict is stored in `Row.extra`
            and shown as extra columns.

    Example:
        >>> rows = run_benchmark(unet, [baseline, ours], lambda: inputs.run(unet))  # doctest: +SKIP
    """
    settings = settings or BenchSettings()
    if not methods:
        raise ValueError("Expected at least one method (the baseline first), but got none.")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"Expected unique method names, but got {names}.")
    device = next(unet.parameters()).device
    n = len(methods)

    methods[0].apply(unet)
    try:
        reference, blocks = record_block_inputs(unet, forward)
    finally:
        methods[0].remove(unet)
    reference = reference.detach().clone()
    overhead_calls = [m.overhead(blocks) if m.overhead is not None else None for m in methods]

    errors: list[float | None] = [None] * n
    times: list[list[float]] = [[] for _ in range(n)]
    paired_base: list[list[float]] = [[] for _ in range(n)]
    overhead_times: list[list[float]] = [[] for _ in range(n)]
    schedules = [
        _schedule(n, r, settings.baseline_every, r >= settings.warmup) for r in range(settings.warmup + settings.rounds)
    ]
    bar = _progress(sum(len(order) for order in schedules), settings.progress)

    def run(i: int, timed: bool) -> float:
        method = methods[i]
        method.apply(unet)
        try:
            out, seconds = _timed(forward, device)
        finally:
            method.remove(unet)
        if errors[i] is None:
            errors[i] = relative_error(out, reference)
        del out
        if timed and overhead_calls[i] is not None:
            overhead_times[i].append(_timed(overhead_calls[i], device)[1])
        bar.update(1)
        return seconds

    try:
        for round_index, order in enumerate(schedules):
            timed = round_index >= settings.warmup
            bar.set_description("warm-up" if not timed else f"round {round_index - settings.warmup + 1}")
            if not timed:
                for i in order:
                    run(i, timed=False)
                continue
            # Timed: baseline, a few methods, baseline, ... (the schedule starts and ends with the
            # baseline); each method is paired with the mean of the baseline runs around its group.
            pending: list[tuple[int, float]] = []
            previous = 0.0
            for i in order:
                seconds = run(i, timed=True)
                if i != 0:
                    pending.append((i, seconds))
                    continue
                times[0].append(seconds)
                paired_base[0].append(seconds)
                for j, method_seconds in pending:
                    times[j].append(method_seconds)
                    paired_base[j].append((previous + seconds) / 2)
                pending, previous = [], seconds
    finally:
        bar.close()

    memory: list[tuple[float | None, float | None]] = [(None, None)] * n
    if settings.measure_memory:
        for i, method in enumerate(methods):
            method.apply(unet)
            try:
                memory[i] = _peak_memory(forward, device, settings.memory_interval)
            finally:
                method.remove(unet)

    rows = []
    for i, method in enumerate(methods):
        speedups = [b / t for b, t in zip(paired_base[i], times[i], strict=True)]
        shares = [o / b for o, b in zip(overhead_times[i], paired_base[i], strict=False)]
        rows.append(
            Row(
                name=method.name,
                family=method.family,
                ratio=method.ratio,
                seconds=statistics.median(times[i]),
                speedup=statistics.median(speedups),
                rel_error=float(errors[i]),
                peak_memory_mib=memory[i][0],
                memory_before_mib=memory[i][1],
                overhead_seconds=_median(overhead_times[i]),
                overhead_share=_median(shares),
                times=times[i],
                overhead_times=overhead_times[i],
                extra=dict(extra_metrics(method)) if extra_metrics is not None else {},
                settings=dict(method.settings),
            )
        )
    return rows


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, unit="fwd", disable=not enabled, leave=False)
