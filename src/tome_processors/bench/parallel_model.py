"""What ToMe should give on several GPUs under Ulysses context parallelism: a model built from one GPU's measured
forward times and the sizes of the collectives, for a setup that was not run.

    python -m tome_processors.bench.parallel_model --one-gpu 4=l4.json 8=l8.json --blocks 40 \\
        --counts u2.json r4.json r8.json --width 5120 --heads 40 --link 450 64

The model, printed with its table:
- compute splits evenly: each of P GPUs does 1/P of the one-GPU forward at the same efficiency (Ulysses splits the
  attention by heads and everything else by tokens);
- per block, Ulysses' all-to-alls carry four tensors of the tokens a rank's self-attention holds (queries, keys,
  values, output; `bench --parallel` counts exactly these, and its test checks the count), and (P-1)/P of them leave
  the GPU; the gather of the output at the end is left out (a few channels a token);
- with ToMe, a rank's attentions hold the share of its tokens that `bench --parallel` counted at the clip's grid (the
  queries of the first attention, per rank count P);
- transfers do not overlap compute (diffusers waits on each all-to-all before the attention), at `link` GB/s per
  GPU each way.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .parallel import parse_parallel

__all__ = ["Projection", "format_projections", "project_ulysses", "whole_forward_seconds"]


@dataclass(frozen=True)
class Projection:
    """One method on `gpus` GPUs: seconds per forward, split into compute and transfer, and the speed-up over the
    same GPUs without ToMe."""

    method: str
    gpus: int
    link_gbps: float
    compute_seconds: float
    transfer_seconds: float
    transfer_bytes: float
    speedup: float
    one_gpu_speedup: float

    @property
    def seconds(self) -> float:
        """Seconds per forward."""
        return self.compute_seconds + self.transfer_seconds


def whole_forward_seconds(by_layers: Mapping[int, Mapping[str, float]], blocks: int) -> dict[str, float]:
    """Each method's seconds per forward of the whole `blocks`-block model, from forwards measured with fewer blocks:
    a line through two block counts (what lies outside the blocks is the intercept), or the one count given when it
    is `blocks`.

    Raises:
        ValueError: one count that is not `blocks`, or methods that differ between the counts.

    Example:
        >>> whole_forward_seconds({4: {"baseline": 1.3}, 8: {"baseline": 2.5}}, 40)["baseline"]
        12.1
    """
    counts = sorted(by_layers)
    if len(counts) == 1:
        if counts[0] != blocks:
            raise ValueError(f"Expected forwards of {blocks} blocks or of two block counts, but got {counts[0]} only.")
        return dict(by_layers[counts[0]])
    low, high = by_layers[counts[0]], by_layers[counts[-1]]
    if set(low) != set(high):
        raise ValueError(f"Expected the same methods at every block count, but got {sorted(low)} and {sorted(high)}.")
    whole = {}
    for method in low:
        slope = (high[method] - low[method]) / (counts[-1] - counts[0])
        whole[method] = round(low[method] + slope * (blocks - counts[0]), 12)
    return whole


def project_ulysses(
    one_gpu: Mapping[str, float],
    kept: Mapping[int, Mapping[str, float]],
    *,
    tokens: int,
    blocks: int,
    width: int,
    element_size: int,
    link_gbps: float,
) -> list[Projection]:
    """Each method of `one_gpu` (seconds per forward on one GPU, with a "baseline") on each GPU count of `kept`
    (per count, each method's share of a rank's tokens its attentions hold; the baseline's is 1).

    Example:
        >>> rows = project_ulysses({"baseline": 1.0, "fast": 0.25}, {2: {"baseline": 1.0, "fast": 0.25}},
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
            # Four tensors a block of the rank's held tokens; (P - 1) / P of them go to other GPUs.
            held = kept[gpus][method] * tokens / gpus
            moved = 4 * held * width * element_size * blocks * (gpus - 1) / gpus
            row = Projection(
                method,
                gpus,
                link_gbps,
                one_gpu[method] / gpus,
                moved / (link_gbps * 1e9),
                moved,
                1.0,
                one_gpu["baseline"] / one_gpu[method],
            )
            plain = plain or row
            rows.append(_with_speedup(row, plain.seconds / row.seconds))
    return rows


def _with_speedup(row: Projection, speedup: float) -> Projection:
    return Projection(**{**vars(row), "speedup": speedup})


def format_projections(rows: Sequence[Projection]) -> str:
    """The model's table, a row per link, GPU count and method."""
    lines = [
        "| link GB/s | GPUs | method | s/forward | compute s | transfer s | GB out a GPU | speed-up on these GPUs | "
        "speed-up on 1 GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.link_gbps:g} | {row.gpus} | {row.method} | {row.seconds:.3f} | {row.compute_seconds:.3f} | "
            f"{row.transfer_seconds:.3f} | {row.transfer_bytes / 1e9:.2f} | {row.speedup:.2f}x | "
            f"{row.one_gpu_speedup:.2f}x |"
        )
    return "\n".join(lines)


def _method(row: dict) -> str:
    """A bench row's method as the parallel bench names it: "baseline" or the preset's name."""
    family = row.get("family") or row["name"]
    return family.removeprefix("ours ")


def _read_one_gpu(specs: Sequence[str]) -> dict[int, dict[str, float]]:
    by_layers = {}
    for spec in specs:
        layers, _, path = spec.partition("=")
        if not layers.isdigit() or not path:
            raise ValueError(f"Expected --one-gpu as BLOCKS=PATH (a bench --json file), but got {spec!r}.")
        rows = json.loads(Path(path).read_text())["rows"]
        by_layers[int(layers)] = {_method(row): float(row["seconds"]) for row in rows}
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
    parser.add_argument("--width", type=int, required=True, help="attention width (heads x head dim)")
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
    rows = [
        row
        for link in args.link
        for row in project_ulysses(
            one_gpu,
            kept,
            tokens=tokens,
            blocks=args.blocks,
            width=args.width,
            element_size=args.element_size,
            link_gbps=link,
        )
    ]
    print(format_projections(rows))
    seconds = ", ".join(f"{name} {value:.3f} s" for name, value in one_gpu.items())
    print(f"\none GPU, {args.blocks} blocks: {seconds}; {tokens} tokens; model: this module's doc")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
