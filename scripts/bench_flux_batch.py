"""Flux at batch >= 2: merged attention in one call (a rotary table per sample) against one call per sample.

Both ways run in one process on one set of weights, in interleaved rounds: the baseline (no ToMe), and each
ToMe configuration twice, once with diffusers' `FluxAttnProcessor` (the batch in one call,
`batched_rotary.SampleTables`) and once with a subclass of it that ToMe runs one sample at a time (the path
every batch took before the batched one, and the one any processor not known to take per-sample tables still
takes). FLUX.1-dev's real width, depth shortened to `--layers` double-stream and `--layers` single-stream blocks.
Prints seconds per forward (medians), the paired ratio of one-at-a-time over batched (median of the per-round
ratios), and aten ops per merged block (ToMe's ops minus the baseline's over the merged blocks).

Example:
    $ PYTHONPATH=$PWD/src python scripts/bench_flux_batch.py --layers 1 --resolution 256 --rounds 3 --configs exact
    $ PYTHONPATH=$PWD/src python scripts/bench_flux_batch.py --quick --resolution 512 --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import tome_processors as tp
from tome_processors.bench.dit import (
    QUICK_TEXT_TOKENS,
    TRANSFORMER_ARCHITECTURES,
    build_transformer,
    make_transformer_inputs,
)
from tome_processors.bench.hostcost import count_aten_ops


class OneSampleAtATime(FluxAttnProcessor):
    """Flux's processor under another type: ToMe does not give it per-sample tables, so runs it per sample."""


def build(layers: int, seed: int, quick: bool) -> FluxTransformer2DModel:
    if quick:  # the tiny FLUX of `bench --quick`, where the host's work dominates as on a GPU
        return build_transformer("flux", quick=True, seed=seed)
    config = dict(TRANSFORMER_ARCHITECTURES["flux"], num_layers=layers, num_single_layers=layers)
    torch.manual_seed(seed)
    return FluxTransformer2DModel(**config).eval()


def sharing_weights(model: FluxTransformer2DModel) -> FluxTransformer2DModel:
    """Another model object on the same parameter tensors (no copy)."""
    with torch.device("meta"):
        other = FluxTransformer2DModel(**model.config)
    other.load_state_dict(model.state_dict(), assign=True)
    return other.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="double-stream and single-stream blocks, each")
    parser.add_argument("--quick", action="store_true", help="the tiny FLUX of `bench --quick` (width 32) instead")
    parser.add_argument("--resolution", type=int, default=512, help="image side in pixels")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", default=["exact", "balanced"], choices=["exact", "balanced"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    base = build(args.layers, args.seed, args.quick)
    text = QUICK_TEXT_TOKENS if args.quick else None
    inputs = make_transformer_inputs(base, "flux", args.batch, args.resolution, seed=args.seed, text_tokens=text)
    configs = {name: {"exact": {}, "balanced": {"share_level": True}}[name] for name in args.configs}
    methods = {"baseline": base}
    for name, options in configs.items():
        for way, processor in (("batched", FluxAttnProcessor), ("per sample", OneSampleAtATime)):
            model = sharing_weights(base)
            model.set_attn_processor(processor())
            tp.apply_tome(model, **options)
            methods[f"{name}, {way}"] = model

    def run(model: torch.nn.Module) -> torch.Tensor:
        return inputs.run(model)

    baseline_ops = sum(count_aten_ops(lambda: run(base))[1].values())
    blocks = len(base.transformer_blocks) + len(base.single_transformer_blocks)
    ops = {}
    for name, model in methods.items():
        run(model)  # warm-up: the first forward fills the per-grid caches
        ops[name] = (sum(count_aten_ops(lambda model=model: run(model))[1].values()) - baseline_ops) / blocks
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # a different order every round
            start = time.perf_counter()
            run(methods[name])
            times[name].append(time.perf_counter() - start)

    tokens = (args.resolution // 16) ** 2
    width = "tiny FLUX (bench --quick)" if args.quick else "FLUX.1-dev width"
    print(
        f"{width}, {len(base.transformer_blocks)} + {len(base.single_transformer_blocks)} blocks, "
        f"{args.resolution} px ({tokens} image tokens), "
        f"batch {args.batch}, float32, {torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    print("| method | s/forward (median) | speed-up over baseline | aten ops per merged block |")
    print("|---|---|---|---|")
    baseline = statistics.median(times["baseline"])
    for name in names:
        median = statistics.median(times[name])
        cost = "-" if name == "baseline" else f"{ops[name]:.1f}"
        print(f"| {name} | {median:.3f} | {baseline / median:.3f}x | {cost} |")
    for name in configs:
        paired = [a / b for a, b in zip(times[f"{name}, per sample"], times[f"{name}, batched"], strict=True)]
        print(f"{name}: per sample / batched, paired per round: median {statistics.median(paired):.3f}x "
              f"({', '.join(f'{p:.3f}' for p in paired)})")  # fmt: skip


if __name__ == "__main__":
    main()
