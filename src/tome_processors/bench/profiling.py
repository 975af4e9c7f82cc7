"""Where one forward's time goes, op by op: `bench --profile PATH`.

A method that merges tokens saves arithmetic in some ops and adds others (the matching, the gathers of merge
and unmerge). The speed-up column says whether the sum pays; this says which ops moved. One forward per method
runs under `torch.profiler`: on CUDA each op's self time on the device (its kernels), elsewhere its self time
on the CPU. The report is a markdown table per method with the ops that took the most time, after a line with
attention's own kernels (scaled dot-product attention, forward and backward): their share `a` of the total bounds
what any method that shortens attention alone can give, `1 / (1 - a)`, whatever the rest of the model costs.

Example:
    >>> _, profile = profile_forward(lambda: torch.ones(64, 64) @ torch.ones(64, 64), torch.device("cpu"))
    >>> profile.clock, any(op.name == "aten::mm" for op in profile.ops)
    ('cpu', True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ForwardProfile",
    "OpTime",
    "is_attention_op",
    "op_times",
    "profile_forward",
    "profile_report",
    "save_profile_report",
]


@dataclass
class OpTime:
    """One op's share of a forward: its name, how often it ran, its self time in milliseconds."""

    name: str
    calls: int
    self_ms: float


@dataclass
class ForwardProfile:
    """One forward's time by op (see the module docstring).

    Attributes:
        clock: `"cuda"` (self time on the device) or `"cpu"` (self time on the host).
        total_ms: every op's self time summed, in milliseconds.
        ops: the ops that took the most self time, the largest first (`top` of them).
        attention_ms: the self time of the attention kernels' ops (`is_attention_op`), all of them.
    """

    clock: str
    total_ms: float
    ops: list[OpTime] = field(default_factory=list)
    attention_ms: float = 0.0

    @property
    def attention_bound(self) -> float:
        """The most a method that makes attention's kernels cheaper (and nothing else) could speed this up by.

        Example:
            >>> ForwardProfile("cuda", 10.0, attention_ms=6.0).attention_bound
            2.5
        """
        rest = self.total_ms - self.attention_ms
        return self.total_ms / rest if rest > 0 else float("inf")


def is_attention_op(name: str) -> bool:
    """Whether an op is one of attention's kernels: SDPA's backends forward or backward (flash, memory-efficient,
    cuDNN, the CPU's), xFormers' `memory_efficient_attention`. Composite ops that only dispatch have no self time.

    Example:
        >>> is_attention_op("aten::_cudnn_attention_backward"), is_attention_op("aten::addmm")
        (True, False)
    """
    return "attention" in name.lower()


def profile_forward(call: Callable[[], Any], device: torch.device, top: int = 20) -> tuple[Any, ForwardProfile]:
    """Run `call()` (one forward) under `torch.profiler`: `(its result, ForwardProfile of its top ops)`."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        out = call()
        if cuda:
            torch.cuda.synchronize(device)
    return out, op_times(profiler.key_averages(), cuda, top)


def op_times(averages: Sequence[Any], cuda: bool, top: int = 20) -> ForwardProfile:
    """A `ForwardProfile` from `torch.profiler`'s averaged events (`profile.key_averages()`).

    On CUDA the profiler lists each kernel as an event of its own and gives each op the device time of the
    kernels it launched: the ops are ranked by that, and the total is the kernels' own time (counting both
    would count every kernel twice). Elsewhere every event is an op, ranked by its self time on the CPU.
    """
    if cuda:
        ops = [(e.key, e.count, _device_us(e)) for e in averages if e.device_type == torch.autograd.DeviceType.CPU]
        total = sum(_device_us(e) for e in averages if e.device_type != torch.autograd.DeviceType.CPU)
    else:
        ops = [(e.key, e.count, float(e.self_cpu_time_total)) for e in averages]
        total = sum(us for *_, us in ops)
    ops = sorted((entry for entry in ops if entry[2] > 0), key=lambda entry: -entry[2])
    top_ops = [OpTime(name, calls, us / 1000) for name, calls, us in ops[:top]]
    attention_us = sum(us for name, _, us in ops if is_attention_op(name))
    return ForwardProfile("cuda" if cuda else "cpu", total / 1000, top_ops, attention_us / 1000)


def _device_us(event: Any) -> float:
    """An averaged event's self time on the device, in microseconds (torch < 2.4 calls it `cuda`)."""
    device_time = getattr(event, "self_device_time_total", None)
    return float(event.self_cuda_time_total if device_time is None else device_time)


def profile_report(named: Sequence[tuple[str, ForwardProfile]]) -> str:
    """A markdown section per method: its total, then a row per top op with its share of the total.

    Example:
        >>> print(profile_report([("baseline", ForwardProfile("cpu", 2.0, [OpTime("aten::mm", 1, 1.5)]))]))
        ### baseline: 2.000 ms of op self time on the cpu
        <BLANKLINE>
        attention kernels: 0.000 ms (0.0%); shortening attention alone gains at most 1.00x here
        <BLANKLINE>
        | op | calls | self ms | share % |
        |---|---|---|---|
        | aten::mm | 1 | 1.500 | 75.0 |
    """
    sections = []
    for name, profile in named:
        lines = [
            f"### {name}: {profile.total_ms:.3f} ms of op self time on the {profile.clock}",
            "",
            f"attention kernels: {profile.attention_ms:.3f} ms ({_percent(profile.attention_ms, profile.total_ms)}%); "
            f"shortening attention alone gains at most {profile.attention_bound:.2f}x here",
            "",
            "| op | calls | self ms | share % |",
            "|---|---|---|---|",
        ]
        for op in profile.ops:
            share = _percent(op.self_ms, profile.total_ms)
            lines.append(f"| {op.name.replace('|', '/')} | {op.calls} | {op.self_ms:.3f} | {share} |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole if whole else 0.0:.1f}"


def save_profile_report(named: Sequence[tuple[str, ForwardProfile]], path: str | Path, header: str = "") -> Path:
    """Write `profile_report(named)` to `path`, after `header` (the run's command, say)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = profile_report(named)
    path.write_text((f"{header}\n\n" if header else "") + text + "\n", encoding="utf-8")
    return path
