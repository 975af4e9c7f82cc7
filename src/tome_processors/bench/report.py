"""Rendering of `tome-processors bench` results: markdown table, JSON, speed-up/error plot, image grid.

`json_safe` and `format_number` are also what `tome-processors eval` writes its reports with: infinity
is the string `"inf"` in JSON (a PSNR between identical images), NaN is `null`.

Example:
    >>> print(markdown_table(rows))  # doctest: +SKIP
    | method | ratio | s/forward | baseline s/forward | speed-up | speed-up min-max | error % | overhead % | ...
    ...
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from .engine import Row

__all__ = [
    "IDLE_MARK",
    "format_number",
    "idle_reason",
    "json_safe",
    "markdown_table",
    "meta_lines",
    "save_grid",
    "save_json",
    "save_plot",
]

#: Beside the name of a row that merges nothing in its forwards (`Row.merges` False); a footnote says why.
IDLE_MARK = "*"

#: `s/forward`, `baseline s/forward` and `speed-up` come from one round (the one whose paired ratio is the median),
#: so the speed-up is the ratio of the two times shown; `speed-up min-max` spans the ratios of every round.
_COLUMNS = (
    "method",
    "ratio",
    "s/forward",
    "baseline s/forward",
    "speed-up",
    "speed-up min-max",
    "error %",
    "overhead %",
    "peak MiB",
)
#: Host-cost columns: (header, Row attribute); a column is shown when any row has a value.
_HOST_COLUMNS = (
    ("aten ops", "aten_ops"),
    ("sync ops", "sync_ops"),
    ("CUDA kernels", "cuda_kernels"),
    ("CUDA syncs", "cuda_syncs"),
    ("compiles", "compiles"),
)


def format_number(value: Any, digits: int = 3, fixed: bool = False) -> str:
    """A table cell: `-` for None, `inf` / `-inf` / `nan`, floats to `digits` significant digits (or decimals).

    Example:
        >>> format_number(None), format_number(math.inf), format_number(0.012345), format_number(2.5, 2, fixed=True)
        ('-', 'inf', '0.0123', '2.50')
    """
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if fixed:
            return f"{value:.{digits}f}"
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _extra_keys(rows: Sequence[Row]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row.extra if k not in keys]
    return keys


def markdown_table(rows: Sequence[Row], unit: str = "forward", error: str = "error %") -> str:
    """A markdown table, one line per row; `Row.extra` metrics become extra columns.

    `unit` names what one timed run is (`s/forward`, or `s/step` for training steps) and `error` the
    column `Row.rel_error` is shown in.

    Example:
        >>> from tome_processors.bench.engine import Row
        >>> ours = Row("ours", "ours", 0.5, 1.2, 1.25, 0.03, pair_seconds=1.2, pair_baseline_seconds=1.5)
        >>> ours.speedup_min, ours.speedup_max = 1.1, 1.3
        >>> for line in markdown_table([Row("baseline", "baseline", None, 1.5, 1.0, 0.0), ours]).splitlines()[2:]:
        ...     print(line)
        | baseline | - | 1.500 | 1.500 | 1.00x | - | 0.00 | - | - |
        | ours | 0.5 | 1.200 | 1.500 | 1.25x | 1.10-1.30x | 3.00 | - | - |

    A row that merged nothing in its forwards (`Row.merges` False) is marked `IDLE_MARK`, and a footnote under the
    table names it with why (`Row.idle`).
    """
    extra = [key for key in _extra_keys(rows) if key != error]
    host = [(title, key) for title, key in _HOST_COLUMNS if any(getattr(row, key) is not None for row in rows)]
    renamed = {"s/forward": f"s/{unit}", "baseline s/forward": f"baseline s/{unit}", "error %": error}
    columns = [renamed.get(c, c) for c in _COLUMNS]
    header = [*columns, *(title for title, _ in host), *extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [
            f"{row.name} {IDLE_MARK}" if row.merges is False else row.name,
            format_number(row.ratio),
            f"{_or(row.pair_seconds, row.seconds):.3f}",
            f"{_or(row.pair_baseline_seconds, row.seconds):.3f}",
            f"{row.speedup:.2f}x",
            _spread(row),
            f"{100 * row.rel_error:.2f}",
            "-" if row.overhead_share is None else f"{100 * row.overhead_share:.2f}",
            "-" if row.peak_memory_mib is None else f"{row.peak_memory_mib:.0f}",
            *(format_number(getattr(row, key)) for _, key in host),
            *(format_number(row.extra.get(k)) for k in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _idle_footnotes(rows))


def _idle_footnotes(rows: Sequence[Row]) -> list[str]:
    """A line per reason under the table: the rows that merged nothing, and why."""
    reasons: dict[str, list[str]] = {}
    for row in rows:
        if row.merges is False:
            reasons.setdefault(row.idle or _IDLE, []).append(row.name)
    return [""] * bool(reasons) + [f"{IDLE_MARK} {', '.join(names)}: {why}" for why, names in reasons.items()]


#: What every footnote of a row that merged nothing starts with: how the bench knows.
_IDLE = "merges nothing in these forwards (the linear layers got as many tokens as in the baseline's)"


def idle_reason(row: Row, device_type: str, forced_columns: Sequence[str] = ()) -> str:
    """Why `row`, which merged nothing in its forwards, merged nothing, and what its columns then show.

    `forced_columns`: the columns measured elsewhere with merging forced on (the trained-model ones).

    Example:
        >>> from tome_processors.bench.engine import Row
        >>> row = Row("ours fast", "ours fast", None, 1.0, 1.0, 0.0, settings={"pays_only": True})
        >>> idle_reason(row, "cpu").split(": ")[1][:56]
        'the pays rule (pays_only=True, as in every preset) keeps'
    """
    if row.settings.get("pays_only"):
        why = (
            f"the pays rule (pays_only=True, as in every preset) keeps merging off at this size on {device_type}; "
            "pays_only=False (the --ratios rows, apply_tome(..., pays_only=False)) merges wherever selected"
        )
    else:
        why = "no site it selects is merged at this size"
    line = f"{_IDLE}: {why}. Speed-up, error and host cost there are the unmerged model's"
    if forced_columns:
        line += (
            f"; {', '.join(forced_columns)} there come from the trained model with merging forced on, not from "
            "these forwards"
        )
    return line + "."


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _spread(row: Row) -> str:
    """The lowest and highest per-round speed-up, `-` where there is none (the baseline)."""
    if row.speedup_min is None or row.speedup_max is None:
        return "-"
    return f"{row.speedup_min:.2f}-{row.speedup_max:.2f}x"


def meta_lines(meta: dict[str, Any]) -> str:
    """`key: value` lines of the run's machine, versions and settings."""
    return "\n".join(f"- {key}: {value}" for key, value in meta.items())


def json_safe(value: Any) -> Any:
    """`value` made strict JSON: infinity as `"inf"` / `"-inf"`, NaN as None, keys and unknown objects as strings.

    Example:
        >>> json_safe({"psnr": math.inf, "x": [math.nan, -math.inf, 1.5], 2: (True, None)})
        {'psnr': 'inf', 'x': [None, '-inf', 1.5], '2': [True, None]}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def save_json(rows: Sequence[Row], meta: dict[str, Any], path: str | Path) -> Path:
    """`{"meta": {...}, "rows": [every Row field, extra metrics under "extra"]}` written to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": json_safe(meta), "rows": [json_safe(asdict(row)) for row in rows]}
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def save_plot(rows: Sequence[Row], path: str | Path, title: str = "", error_key: str | None = None) -> Path:
    """A PNG of speed-up (y) against output error (x), one curve per method family, points labelled by ratio.

    `error_key` names an extra metric (already in percent) to use as the x axis instead of the
    random-weight relative error, e.g. the trained denoiser's noise-prediction change.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    families: dict[str, list[Row]] = {}
    for row in rows:
        families.setdefault(row.family, []).append(row)
    for family, members in families.items():
        members = sorted(members, key=lambda r: (r.ratio is None, r.ratio or 0.0))
        xs = [100 * r.rel_error if error_key is None else float(r.extra[error_key]) for r in members]
        ys = [r.speedup for r in members]
        style = "o-" if len(members) > 1 else "s"
        ax.plot(xs, ys, style, label=family)
        for r, x, y in zip(members, xs, ys, strict=True):
            if r.ratio is not None:
                ax.annotate(f"{r.ratio:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel(
        "output change: relative L2 error of the UNet output (%)"
        if error_key is None
        else f"trained denoiser: {error_key.replace(' %', '')} (%)"
    )
    ax.set_ylabel("speed-up per UNet forward (x)")
    ax.set_title(title or "speed-up against output change")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def save_grid(images: Sequence[Any], labels: Sequence[str], path: str | Path, columns: int = 4) -> Path:
    """PIL images side by side (at least 160 px wide each), each with its label (may hold `\\n`) below it."""

    if len(images) != len(labels) or not images:
        raise ValueError(f"Expected as many labels as images (> 0), but got {len(images)} and {len(labels)}.")
    width, height = images[0].size
    scale = max(1, math.ceil(160 / width))
    cell_w, cell_h = width * scale, height * scale
    label_h = 14 * (1 + max(label.count("\n") for label in labels)) + 6
    columns = max(1, min(columns, len(images)))
    grid_rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * cell_w, grid_rows * (cell_h + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        x, y = (index % columns) * cell_w, (index // columns) * (cell_h + label_h)
        grid.paste(image.convert("RGB").resize((cell_w, cell_h), Image.NEAREST), (x, y))
        draw.multiline_text((x + 4, y + cell_h + 3), label, fill="black", spacing=2)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path
