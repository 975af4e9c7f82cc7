"""What ToMe should give on several GPUs under Ulysses context parallelism: a model built from one GPU's measured
forward times and the sizes of the collectives, for a setup that was not run.

    python -m tome_processors.bench.parallel_model --one-gpu 4=l4.json 8=l8.json --blocks 40 \\
        --counts u2.json r4.json r8.json --width 5120 --heads 40 --link 450 64

The model, printed with its table:
- compute splits evenly: each of P GPUs does 1/P of the one-GPU forward at the same efficiency (Ulysses splits the
  attention by heads and everything else by tokens);
- with ToMe, a rank's attentions hold the share of its tokens that `bench --parallel` counted at the clip's grid (the
  queries of the first attention, per rank count P), which may differ from the share one process holds (counted
  here with the same quick model, `--kept-one`): the one-GPU attention time (the profile's share of the forward)
  scales with the square of the ratio of the two, the rest of the forward is kept;
- per block, Ulysses' all-to-alls carry four tensors of the tokens a rank's self-attention holds (queries, keys,
  values, output; `bench --parallel` counts exactly these, and its test checks the count), and (P-1)/P of them leave
  the GPU; the gather of the output at the end is left out (a few channels a token);
- transfers do not overlap compute (diffusers waits on each all-to-all before the attention), at `link` GB/s per
  GPU each way.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..apply import apply_tome
from .dit import build_transformer, make_transformer_inputs
from .parallel import first_attention_queries, parse_parallel

__all__ = [
    "OneGpuTime",
    "Projection",
    "format_projections",
    "one_process_kept",
    "project_ulysses",
    "whole_forward_seconds",
]


class OneGpuTime(NamedTuple):
    """One method's seconds per forward on one GPU: in the attention kernels, and the rest."""

    attention: float
    other: float

    @property
    def total(self) -> float:
        """Seconds per forward."""
        return self.attention + self.other


@dataclass(frozen=True)
class Projection:
    """One method on `gpus` GPUs: seconds per forward, split into compute and transfer, and the speed-up over the
    same GPUs without ToMe."""

    method: str
    gpus: int
    link_gbps: float
    kept: float
    compute_seconds: float
    transfer_seconds: float
    transfer_bytes: float
    speedup: float
    one_gpu_speedup: float

    @property
    def seconds(self) -> float:
        """Seconds per forward."""
        return self.compute_seconds + self.transfer_seconds


def whole_forward_seconds(by_layers: Mapping[int, Mapping[str, OneGpuTime]], blocks: int) -> dict[str, OneGpuTime]:
    """Each method's seconds per forward of the whole `blocks`-block model, from forwards measured with fewer blocks:
    a line through two block counts for each part (what lies outside the blocks is the intercept), or the one count
    given when it is `blocks`.

    Raises:
        ValueError: one count that is not `blocks`, or methods that differ between the counts.

    Example:
        >>> whole_forward_seconds({4: {"baseline": OneGpuTime(1.0, 0.3)}, 8: {"baseline": OneGpuTime(2.0, 0.5)}}, 40)
        {'baseline': OneGpuTime(attention=10.0, other=2.1)}
    """
    counts = sorted(by_layers)
    if len(counts) == 1:
        if counts[0] != blocks:
            raise ValueError(f"Expected forwards of {blocks} blocks or of two block counts, but got {counts[0]} only.")
        return dict(by_layers[counts[0]])
    low, high = by_layers[counts[0]], by_layers[counts[-1]]
    if set(low) != set(high):
        raise ValueError(f"Expected the same methods at every block count, but got {sorted(low)} and {sorted(high)}.")
    span = counts[-1] - counts[0]
    return {
        method: OneGpuTime(
            *(
                round(a + (b - a) / span * (blocks - counts[0]), 12)
                for a, b in zip(low[method], high[method], strict=True)
            )
        )
        for method in low
    }


def project_ulysses(
    one_gpu: Mapping[str, OneGpuTime],
    kept: Mapping[int, Mapping[str, float]],
    kept_one: Mapping[str, float],
    *,
    tokens: int,
    blocks: int,
    width: int,
    element_size: int,
    link_gbps: float,
) -> list[Projection]:
    """Each method of `one_gpu` (with a "baseline") on each GPU count of `kept` (per count, each method's share of a
    rank's tokens its attentions hold; the baseline's is 1), where one process holds `kept_one`.

    Example:
        >>> one_gpu = {"baseline": OneGpuTime(0.8, 0.2), "fast": OneGpuTime(0.05, 0.2)}
        >>> rows = project_ulysses(one_gpu, {2: {"baseline": 1.0, "fast": 0.25}}, {"baseline": 1.0, "fast": 0.25},
        ...     tokens=1000, blocks=1, width=10, element_size=2, link_gbps=1e-6)
        >>> [(row.method, round(row.transfer_bytes), round(row.speedup, 2)) for row in rows]
        [('baseline', 20000, 1.0), ('fast', 5000, 4.0)]
    """
    if "baseline" not in one_gpu:
        raise ValueError(f"Expected a baseline among the methods, but got {sorted(one_gpu)}.")
    rows = []
    for gpus in sorted(kept):
        plain = None
        for method in ["baseline", *(name for name in one_gpu if name != "baseline")]:
            if method not in kept[gpus]:
                continue
            share = kept[gpus][method]
            time = one_gpu[method]
            compute = (time.attention * (share / kept_one[method]) ** 2 + time.other) / gpus
            # Four tensors a block of the rank's held tokens; (P - 1) / P of them go to other GPUs.
            moved = 4 * share * tokens / gpus * width * element_size * blocks * (gpus - 1) / gpus
            row = Projection(
                method,
                gpus,
                link_gbps,
                share,
                compute,
                moved / (link_gbps * 1e9),
                moved,
                1.0,
                one_gpu["baseline"].total / time.total,
            )
            plain = plain or row
            rows.append(_with_speedup(row, plain.seconds / row.seconds))
    return rows


def _with_speedup(row: Projection, speedup: float) -> Projection:
    return Projection(**{**vars(row), "speedup": speedup})


def one_process_kept(
    arch: str, resolution: int, width: int, frames: int, presets: Sequence[str], seed: int = 0
) -> dict[str, float]:
    """Each preset's share of the tokens the first attention holds in one process, on the `--quick` model of `arch`
    (one block) at a clip of `frames` frames of `resolution` x `width` pixels; the baseline's is 1.

    Example:
        >>> one_process_kept("wan", 720, 1280, 81, ["balanced"])  # doctest: +SKIP
        {'baseline': 1.0, 'balanced': 0.2857...}
    """
    model = build_transformer(arch, quick=True, seed=seed, layers=1)
    inputs = make_transformer_inputs(
        model, arch, 1, resolution, seed=seed, device=torch.device("cpu"), dtype=torch.float32, frames=frames,
        width=width, quick=True,
    )  # fmt: skip

    def count(copied: torch.nn.Module) -> int:
        with torch.inference_mode():
            return first_attention_queries(copied, lambda: copied(**inputs.kwargs, return_dict=False))

    tokens = count(model)
    kept = {"baseline": 1.0}
    for preset in presets:
        copied = copy.deepcopy(model)
        apply_tome(copied, preset=preset)
        kept[preset] = count(copied) / tokens
    return kept


def format_projections(rows: Sequence[Projection]) -> str:
    """The model's table, a row per link, GPU count and method."""
    lines = [
        "| link GB/s | GPUs | method | tokens held a rank | s/forward | compute s | transfer s | GB out a GPU | "
        "speed-up on these GPUs | speed-up on 1 GPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.link_gbps:g} | {row.gpus} | {row.method} | {row.kept:.1%} | {row.seconds:.3f} | "
            f"{row.compute_seconds:.3f} | {row.transfer_seconds:.3f} | {row.transfer_bytes / 1e9:.2f} | "
            f"{row.speedup:.2f}x | {row.one_gpu_speedup:.2f}x |"
        )
    return "\n".join(lines)


def _method(row: dict) -> str:
    """A bench row's method as the parallel bench names it: "baseline" or the preset's name."""
    family = row.get("family") or row["name"]
    return family.removeprefix("ours ")


def _read_one_gpu(specs: Sequence[str]) -> dict[int, dict[str, OneGpuTime]]:
    by_layers = {}
    for spec in specs:
        layers, _, path = spec.partition("=")
        if not layers.isdigit() or not path:
            raise ValueError(f"Expected --one-gpu as BLOCKS=PATH (a bench --json file), but got {spec!r}.")
        rows = json.loads(Path(path).read_text())["rows"]
        times = {}
        for row in rows:
            share = (row.get("extra") or {}).get("attention %")
            if share is None:
                raise ValueError(f"Expected an attention share in every row of {path} (bench --profile).")
            seconds = float(row["seconds"])
            times[_method(row)] = OneGpuTime(seconds * share / 100, seconds * (1 - share / 100))
        by_layers[int(layers)] = times
    return by_layers


def _read_counts(paths: Sequence[str]) -> tuple[dict[int, dict[str, float]], int]:
    """Per GPU count, each method's share of a rank's tokens held at the first attention; and the clip's tokens."""
    kept, tokens = {}, set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        gpus = parse_parallel(data["meta"]["parallel"]).world_size
        rows = {row["name"]: row for row in data["rows"]}
        local = rows["baseline"]["query_tokens"]
        tokens.add(local * gpus)
        kept[gpus] = {name: row["query_tokens"] / local for name, row in rows.items()}
    if len(tokens) != 1:
        raise ValueError(f"Expected --counts of one clip, but got {sorted(tokens)} tokens.")
    return kept, tokens.pop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_processors.bench.parallel_model", description=__doc__)
    parser.add_argument("--one-gpu", nargs="+", required=True, metavar="BLOCKS=PATH", help="bench --json files")
    parser.add_argument("--blocks", type=int, required=True, help="the whole model's blocks")
    parser.add_argument("--counts", nargs="+", required=True, metavar="PATH", help="bench --parallel --json files")
    parser.add_argument(
        "--clip", nargs=4, required=True, metavar=("ARCH", "RESOLUTION", "WIDTH", "FRAMES"),
        help="the counts' clip, for the tokens one process holds (the quick model of ARCH, counted here)",
    )  # fmt: skip
    parser.add_argument("--attention-width", type=int, required=True, help="heads x head dim of the model")
    parser.add_argument("--heads", type=int, required=True, help="attention heads (Ulysses needs P to divide them)")
    parser.add_argument("--element-size", type=int, default=2, help="bytes an element (2: bf16)")
    parser.add_argument("--link", type=float, nargs="+", required=True, help="GB/s per GPU each way, one or more")
    args = parser.parse_args(argv)
    try:
        one_gpu = whole_forward_seconds(_read_one_gpu(args.one_gpu), args.blocks)
        kept, tokens = _read_counts(args.counts)
    except ValueError as error:
        parser.error(str(error))
    refused = [gpus for gpus in kept if args.heads % gpus]
    if refused:
        parser.error(f"Expected GPU counts that divide the {args.heads} heads (Ulysses), but got {refused}.")
    arch, resolution, width, frames = args.clip
    presets = [name for name in one_gpu if name != "baseline"]
    kept_one = one_process_kept(arch, int(resolution), int(width), int(frames), presets)
    rows = [
        row
        for link in args.link
        for row in project_ulysses(
            one_gpu,
            kept,
            kept_one,
            tokens=tokens,
            blocks=args.blocks,
            width=args.attention_width,
            element_size=args.element_size,
            link_gbps=link,
        )
    ]
    print(format_projections(rows))
    seconds = ", ".join(
        f"{name} {value.total:.3f} s ({value.attention:.3f} in attention)" for name, value in one_gpu.items()
    )
    held = ", ".join(f"{name} {value:.1%}" for name, value in kept_one.items())
    print(f"\none GPU, {args.blocks} blocks: {seconds}; one process holds {held} of {tokens} tokens")
    print("model: python -m tome_processors.bench.parallel_model --help")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
