"""`tome-processors bench --parallel ulysses=2` (or `ring=2`, `ulysses=2,ring=2`, `tp=2`): one forward of a diffusion
transformer split over several processes with diffusers' context or tensor parallelism, with and without ToMe.

The parent spawns one process a rank (gloo on the CPU, NCCL on CUDA GPUs, one GPU a rank). Every rank builds the same
random-weight model, a copy per method (the baseline, then each preset), each copy parallelized alike; the methods'
forwards run in interleaved rounds, each timed between two barriers and taken as the slowest rank's time. A forward
of each method is run once more under a dispatch mode that adds up the bytes that the collectives (diffusers'
all-to-all, all-gather, ring passes, tensor-parallel reductions) send from this rank: counted, not estimated.

On the CPU the bench stands in for what a GPU run has: one device per rank (diffusers picks `rank % device_count`),
the CPU among diffusers' tensor-parallel devices, and an attention kernel that returns the log-sum-exp ring attention
needs (diffusers' native CPU kernel returns none). Those stand-ins are set in the spawned ranks only.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue as queues
import signal
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import diffusers.hooks.tensor_parallel as tensor_parallel
import diffusers.models.attention_dispatch as dispatch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import ContextParallelConfig, TensorParallelConfig
from torch.utils._python_dispatch import TorchDispatchMode

from ..apply import apply_tome
from ..families import find_family
from .dit import build_transformer, make_transformer_inputs
from .meta import resolve_dtype
from .rank_memory import GIB, RankMemory, available_memory, check_rank_memory

__all__ = [
    "CollectiveBytes",
    "ParallelRow",
    "ParallelSpec",
    "RankDied",
    "cpu_stand_ins",
    "parse_parallel",
    "run_parallel_bench",
]

#: Families whose diffusers model has a context-parallel plan, and those with a tensor-parallel one.
CONTEXT_PARALLEL_ARCHS = ("wan", "wan-i2v", "flux", "flux2", "qwenimage", "ltx", "ltx2")
TENSOR_PARALLEL_ARCHS = ("flux", "flux2", "qwenimage")


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


class CollectiveBytes(TorchDispatchMode):
    """Adds up the bytes of the tensors this process hands to collectives (`torch.ops._c10d_functional`, the ops
    diffusers' context and tensor parallelism call), and counts the calls.

    Example:
        >>> with CollectiveBytes() as counted:
        ...     _ = torch.ones(2) + 1
        >>> counted.bytes, counted.calls
        (0, 0)
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        namespace = getattr(func, "namespace", "")
        name = func.__name__
        # `wait_tensor` and `_wrap_tensor_autograd` (which wraps a collective's result) move nothing themselves.
        if namespace in ("_c10d_functional", "c10d_functional", "c10d") and not name.startswith(("wait", "_wrap")):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.calls += 1
        return func(*args, **(kwargs or {}))


@dataclass
class ParallelRow:
    """One method's figures, from rank 0 (times: the slowest rank's per round)."""

    name: str
    seconds: list[float] = field(default_factory=list)
    speedups: list[float] = field(default_factory=list)
    collective_bytes: int = 0
    collective_calls: int = 0
    change: float = 0.0
    query_tokens: int = 0
    #: The model's shape, for reading the bytes per token: its blocks, the width of its attention (heads x head
    #: dim) and the bytes of one element in the run's dtype.
    blocks: int = 0
    attention_width: int = 0
    element_size: int = 0

    @property
    def seconds_per_forward(self) -> float:
        """Median seconds per forward."""
        return statistics.median(self.seconds)

    @property
    def speedup(self) -> float:
        """Median of the paired per-round speed-ups against the baseline."""
        return statistics.median(self.speedups) if self.speedups else 1.0


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


def run_parallel_bench(
    spec: ParallelSpec,
    arch: str,
    presets: Sequence[str],
    *,
    ratios: Sequence[float] = (),
    rounds: int = 3,
    warmup: int = 1,
    resolution: int | None = None,
    width: int | None = None,
    frames: int | None = None,
    layers: int | None = None,
    batch: int = 1,
    seed: int = 0,
    threads: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    quick: bool = False,
    check_memory: bool = True,
) -> list[ParallelRow]:
    """Spawn `spec.world_size` ranks and measure the baseline, each preset and ToMe at each of `ratios` (the
    family's defaults, merging wherever the config selects) on `arch` split by `spec`.

    Before spawning, `check_memory` estimates a rank's peak memory (`bench.rank_memory`) and refuses a run whose ranks
    would not fit this machine's available memory together.

        Raises:
            ValueError: an architecture without diffusers' plan for `spec`, or more GPUs than there are.
            NotEnoughMemory: (a ValueError) the ranks would not fit; the message says what would.
            RankDied: a rank died without a report (killed by a signal, most often the operating system's for memory).

        Example:
            >>> rows = run_parallel_bench(parse_parallel("ulysses=2"), "wan", ["fast"], quick=True)  # doctest: +SKIP
    """
    archs = TENSOR_PARALLEL_ARCHS if spec.tp > 1 else CONTEXT_PARALLEL_ARCHS
    if arch not in archs:
        kind = "tensor" if spec.tp > 1 else "context"
        raise ValueError(
            f"Expected --arch among {list(archs)} (a {kind}-parallel plan in diffusers), but got {arch!r}."
        )
    if device.startswith("cuda") and torch.cuda.device_count() < spec.world_size:
        raise ValueError(f"Expected {spec.world_size} GPUs for --parallel {spec}, but got {torch.cuda.device_count()}.")
    request = ParallelRequest(
        spec,
        arch,
        tuple(presets),
        tuple(ratios),
        rounds,
        warmup,
        resolution or (64 if quick else 480),
        width,
        frames,
        layers,
        batch,
        seed,
        threads,
        "cuda" if device.startswith("cuda") else "cpu",
        dtype,
        quick,
    )
    memory = check_rank_memory(request) if check_memory else None
    results = _spawn(_rank_main, request.spec.world_size, request, memory)
    return [ParallelRow(**row) for row in results[0]]


class RankDied(RuntimeError):
    """A rank of the parallel bench ended without a report: killed by a signal, or exited with a code."""


#: How long the parent waits, after a rank reports a failure, for another rank's death to show (a killed rank makes
#: the others fail in their collectives: "Connection closed by peer").
_DEATH_GRACE_SECONDS = 2.0


def _spawn(rank_main: Callable[..., None], world: int, request: Any, memory: RankMemory | None = None) -> list[Any]:
    """`rank_main(rank, world, port, request, queue)` on `world` spawned processes; each puts `(rank, ok, value)` once.

    Every rank's value, in rank order. A rank that reports a failure raises RuntimeError with its traceback; a rank
    that dies without a report (a signal: the operating system's SIGKILL when memory runs out) raises `RankDied`
    naming it, its signal and `memory`, the estimate it was spawned with, before the other ranks' errors that follow
    from its death."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    available = available_memory()
    processes = [context.Process(target=rank_main, args=(rank, world, port, request, queue)) for rank in range(world)]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}

    def receive(timeout: float) -> None:
        rank, ok, value = queue.get(timeout=timeout)
        (results if ok else failures)[rank] = value

    def dead() -> int | None:  # a rank exits 0 after its report: any other exit without one is a death
        ended = (r for r, p in enumerate(processes) if p.exitcode not in (None, 0))
        return next((r for r in ended if r not in results and r not in failures), None)

    failed_at = None
    try:
        while len(results) < world:
            try:
                receive(0.2)
            except queues.Empty:
                pass
            if dead() is not None:
                with contextlib.suppress(queues.Empty):
                    while True:  # a report on its way from a rank that then died at exit still counts
                        receive(0.5)
                rank = dead()
                if rank is not None:
                    raise RankDied(_death_message(rank, world, processes[rank].exitcode, failures, memory, available))
            if failures and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > _DEATH_GRACE_SECONDS:
                rank = min(failures)
                raise RuntimeError(f"rank {rank} of the parallel bench failed:\n{failures[rank]}")
    finally:
        done = len(results) == world
        for process in processes:
            process.join(timeout=60 if done else 1)
            if process.is_alive():
                process.kill()
                process.join()
    return [results[rank] for rank in range(world)]


def _death_message(
    rank: int, world: int, code: int, failures: dict[int, str], memory: RankMemory | None, available: int
) -> str:
    """Which rank died and how; for SIGKILL the memory estimate it ran with; then the other ranks' last lines."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"was killed by {name}"
    else:
        how = f"exited with code {code} without a report"
    message = f"rank {rank} of the {world} ranks of the parallel bench {how}"
    if code == -signal.SIGKILL:
        message += " (killed by the operating system, likely for memory"
        if memory is not None:
            message += (
                f": a rank was estimated at {memory.total_bytes / GIB:.2f} GiB, with {available / GIB:.2f} GiB "
                f"available for the {world} ranks, {available / world / GIB:.2f} GiB a rank, when they were spawned"
            )
        message += "; --layers, --frames or fewer rows shrink a rank)"
    message += "."
    others = [
        f"rank {other}: {text.strip().splitlines()[-1] if text.strip() else text}"
        for other, text in sorted(failures.items())
        if other != rank
    ]
    if others:
        message += " The other ranks' errors follow from it:\n" + "\n".join(others)
    return message


def _rank_main(rank: int, world: int, port: int, request: ParallelRequest, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(request.threads)
    try:
        if request.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            cpu_stand_ins()
        dist.init_process_group("nccl" if request.device == "cuda" else "gloo", rank=rank, world_size=world)
        try:
            rows = _measure(request, rank)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, rows))
    except BaseException:  # noqa: BLE001 - the parent raises it with this rank's traceback
        queue.put((rank, False, traceback.format_exc()))


def cpu_stand_ins() -> None:
    """The CPU stand-ins (module doc), for this process: call it in a spawned rank only (the tests' ranks too)."""
    torch.accelerator.device_count = lambda: 1  # one device per rank, as diffusers assumes
    if "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES:
        tensor_parallel._SUPPORTED_TP_DEVICES = (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")
    dispatch._native_attention_forward_op = _cpu_attention_op


def _cpu_attention_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> Any:
    """diffusers' native forward op (`(B, S, H, D)` in and out), with the log-sum-exp `(B, S, H)` where asked."""
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    if not return_lse:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
        return out.permute(0, 2, 1, 3)
    if attn_mask is not None:  # the CPU kernel takes an additive mask of the query's type, one per head
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        attn_mask = attn_mask.to(query.dtype).expand(*query.shape[:3], key.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out.permute(0, 2, 1, 3), lse.transpose(1, 2)


def _measure(request: ParallelRequest, rank: int) -> list[dict]:
    device = torch.device("cuda", rank) if request.device == "cuda" else torch.device("cpu")
    dtype = resolve_dtype(request.dtype, device)
    model = build_transformer(request.arch, quick=request.quick, seed=request.seed, layers=request.layers)
    if (device.type, dtype) != ("cpu", torch.float32):
        model = model.to(device, dtype)
    model.set_attention_backend("native")
    inputs = make_transformer_inputs(
        model,
        request.arch,
        request.batch,
        request.resolution,
        seed=request.seed,
        device=device,
        dtype=dtype,
        frames=request.frames,
        width=request.width,
        quick=request.quick,
    )
    options = {"baseline": None, **{name: {"preset": name} for name in request.presets}}
    options.update({f"r={ratio}": {"ratio": ratio} for ratio in request.ratios})
    names = list(options)
    copies = {}
    for index, (name, tome) in enumerate(options.items()):
        # The last row takes the built model itself: a rank holds one copy per row (`bench.rank_memory`), not one more.
        copied = model if index == len(options) - 1 else copy.deepcopy(model)
        copied.enable_parallelism(config=request.spec.config())
        if tome is not None:
            apply_tome(copied, **tome)
        copies[name] = copied
    del model

    def forward(name: str) -> torch.Tensor:
        with torch.inference_mode():
            out = copies[name](**inputs.kwargs, return_dict=False)[0]
        return torch.stack(out) if isinstance(out, list) else out

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    attention = find_family(copies["baseline"]).blocks(copies["baseline"])[0].attentions[0].module
    shape = {
        "blocks": len(find_family(copies["baseline"]).blocks(copies["baseline"])),
        "attention_width": attention.to_q.out_features,
        "element_size": dtype.itemsize,
    }
    rows = {name: ParallelRow(name, **shape) for name in names}
    outputs = {}
    for name in names:
        for _ in range(max(request.warmup, 1)):
            outputs[name] = forward(name)
        with CollectiveBytes() as counted:
            forward(name)
        rows[name].collective_bytes, rows[name].collective_calls = counted.bytes, counted.calls
        rows[name].query_tokens = first_attention_queries(copies[name], lambda name=name: forward(name))
    for round_index in range(request.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]  # each method first in turn
        times = {}
        for name in order:
            synchronize()
            started = time.perf_counter()
            forward(name)
            synchronize()
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            times[name] = float(elapsed)
        for name in names:
            rows[name].seconds.append(times[name])
            rows[name].speedups.append(times["baseline"] / times[name])
    base = outputs["baseline"].float()
    for name in names:
        rows[name].change = float((outputs[name].float() - base).abs().mean() / base.abs().mean())
    return [asdict(rows[name]) for name in names]


def first_attention_queries(model: torch.nn.Module, run: Any) -> int:
    """The queries the first merged self-attention of `model` projects in one forward (this rank's)."""
    attention = find_family(model).blocks(model)[0].attentions[0].module
    seen: list[int] = []
    handle = attention.to_q.register_forward_pre_hook(lambda _, args: seen.append(int(args[0].shape[-2])))
    try:
        run()
    finally:
        handle.remove()
    return seen[0] if seen else 0


def format_parallel_rows(rows: Sequence[ParallelRow], spec: ParallelSpec) -> str:
    """The table `bench --parallel` prints.

    Example:
        >>> row = ParallelRow("baseline", [1.0], [1.0], 2_000_000, 4, 0.0, 100)
        >>> print(format_parallel_rows([row], parse_parallel("ulysses=2")).splitlines()[2])
        | baseline | 1.000 | 1.00x | 2.00 | 1.00x | 4 | 100 | 0.00% |
    """
    base = rows[0].collective_bytes or 1
    lines = [
        f"| method ({spec}) | s/forward | speed-up | collective MB/forward (rank 0) | bytes vs baseline | collective "
        "calls | queries at the first attention (rank 0) | output change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.seconds_per_forward:.3f} | {row.speedup:.2f}x | {row.collective_bytes / 1e6:.2f} | "
            f"{row.collective_bytes / base:.2f}x | {row.collective_calls} | {row.query_tokens} | {row.change:.2%} |"
        )
    return "\n".join(lines)
