"""The merge overhead of this library against tomesd's, alone: the bench's own overhead replays, interleaved.

`tome-processors bench` times each method's merge work (`Method.overhead`) once per round, right after its
forward, as a share of the paired baseline forward. This script times the same replays with nothing else
in between: one reference forward records every block's input, then each round runs ours (a preset, or a
ratio) and tomesd's replay back to back, in alternating order, and prints the median of the per-round
ratio `ours / tomesd` with its lowest and highest value. On a shared CPU the ratio is steadier than either
time; `--threads 1` with `--cpu-time` counts this thread's CPU time instead of the wall clock, which
leaves out the waits for other work on the machine.

Example:
    $ python scripts/overhead_ratio.py --rounds 15
    ours exact: ... ms, tomesd r=0.5: ... ms per forward (medians); ours / tomesd: median ..., min ..., max ...
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tome_processors.bench.engine import record_block_inputs
from tome_processors.bench.methods import ours_methods, preset_methods, tomesd_methods
from tome_processors.bench.unet import ARCHITECTURES, build_unet, make_inputs
from tome_processors.families import find_family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd15", choices=sorted(ARCHITECTURES))
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--preset", default="exact", help='ours as this preset ("exact" is tomesd\'s algorithm)')
    parser.add_argument("--ratio", type=float, default=None, help="ours at this ratio instead of a preset")
    parser.add_argument("--tomesd-ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true", help="this thread's CPU time (with --threads 1)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        parser.error("Expected --threads 1 with --cpu-time (other threads' time is not counted), but got more.")
    clock: Callable[[], float] = time.thread_time if args.cpu_time else time.perf_counter

    unet = build_unet(args.arch).eval()
    inputs = make_inputs(unet, batch=args.batch, resolution=args.resolution)
    with torch.inference_mode():
        recording = record_block_inputs(unet, lambda: inputs.run(unet))._replace(output=None)
    auto_downsample = find_family(unet).auto_downsample(unet)
    if args.ratio is not None:
        (ours,) = ours_methods([args.ratio], auto_downsample)
    else:
        (ours,) = preset_methods([args.preset], unet, auto_downsample)
    (theirs,) = tomesd_methods([args.tomesd_ratio], auto_downsample)
    calls = {ours.name: ours.overhead(recording), theirs.name: theirs.overhead(recording)}
    for call in calls.values():  # warm-up: caches, allocator
        call()

    times: dict[str, list[float]] = {name: [] for name in calls}
    ratios = []
    for round_index in range(args.rounds):
        order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
        for name in order:
            start = clock()
            calls[name]()
            times[name].append(clock() - start)
        ratios.append(times[ours.name][-1] / times[theirs.name][-1])
    medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    print(
        f"{ours.name}: {medians[ours.name]:.1f} ms, {theirs.name}: {medians[theirs.name]:.1f} ms per forward "
        f"(medians); ours / tomesd: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
        f"max {max(ratios):.3f} over {args.rounds} rounds; {args.arch} {args.resolution} px, batch {args.batch}, "
        f"{torch.get_num_threads()} threads, {'CPU time' if args.cpu_time else 'wall time'}"
    )


if __name__ == "__main__":
    main()
