"""Write what `tome-processors eval` measured: CSV, JSON, markdown with plots, labelled grids."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from PIL import Image

from ..bench.report import format_number, json_safe, save_grid
from .engine import EvalConfig, EvalRow, summarize


def write_reports(
    rows: Sequence[EvalRow], configs: Sequence[EvalConfig], out_dir: str | Path, meta: dict[str, Any]
) -> dict[str, Path]:
    """Write `results.csv`, `summary.json`, `report.md`, plots and grids into `out_dir`.

    Returns the paths written, by kind.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows, configs)
    paths = {
        "csv": out_dir / "results.csv",
        "json": out_dir / "summary.json",
        "report": out_dir / "report.md",
    }

    with paths["csv"].open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(EvalRow)])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in asdict(row).items()})

    payload = {"meta": meta, "summary": summary, "rows": [asdict(r) for r in rows]}
    paths["json"].write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False), encoding="utf-8")

    paths.update(_plots(summary, out_dir))
    paths.update(_grids(rows, configs, out_dir))
    paths["report"].write_text(_markdown(summary, meta, paths, out_dir), encoding="utf-8")
    return paths


def _csv_value(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return "" if value is None else value


def _fmt(value: Any, digits: int = 3) -> str:
    return format_number(value, digits, fixed=True)


def _markdown(summary: list[dict[str, Any]], meta: dict[str, Any], paths: dict[str, Path], out_dir: Path) -> str:
    lines = ["# ToMe quality against speed", ""]
    lines += [f"- {key}: `{value}`" for key, value in meta.items()]
    lines += [
        "",
        "| config | images | s/image (median) | speed-up | CLIP score | PSNR vs baseline (dB) | SSIM vs baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['config']} | {s['images']} | {_fmt(s['seconds_median'])} | {_fmt(s['speedup'], 2)}x | "
            f"{_fmt(s['clip_score_mean'], 2)} | {_fmt(s['psnr_mean'], 2)} | {_fmt(s['ssim_mean'])} |"
        )
    lines += ["", "CLIP score: 100 x cosine(image, prompt), mean over images; PSNR/SSIM: mean over images,"]
    lines += ["against the baseline image of the same prompt and seed.", ""]
    for kind in ("plot_speed", "plot_change"):
        if kind in paths:
            lines.append(f"![{kind}]({paths[kind].relative_to(out_dir).as_posix()})")
    grids = sorted(p for k, p in paths.items() if k.startswith("grid_"))
    if grids:
        lines += ["", "## Grids", ""]
        lines += [f"![{g.stem}]({g.relative_to(out_dir).as_posix()})" for g in grids]
    return "\n".join(lines) + "\n"


def _plots(summary: list[dict[str, Any]], out_dir: Path) -> dict[str, Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: the tables carry the same numbers
        return {}
    paths = {}
    ratios = [s["ratio"] for s in summary]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ratios, [s["seconds_median"] for s in summary], marker="o")
    ax.set_xlabel("ratio")
    ax.set_ylabel("seconds per image (median)")
    ax.set_title("Speed")
    fig.tight_layout()
    paths["plot_speed"] = out_dir / "speed.png"
    fig.savefig(paths["plot_speed"], dpi=100)
    plt.close(fig)

    tome = [s for s in summary[1:] if s["psnr_mean"] is not None]
    if tome:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([s["ratio"] for s in tome], [s["psnr_mean"] for s in tome], marker="o", label="PSNR (dB)")
        ax.set_xlabel("ratio")
        ax.set_ylabel("PSNR vs baseline (dB)")
        if any(s["clip_score_mean"] is not None for s in summary):
            twin = ax.twinx()
            twin.plot(ratios, [s["clip_score_mean"] for s in summary], marker="s", color="tab:orange")
            twin.set_ylabel("CLIP score", color="tab:orange")
        ax.set_title("Change against the baseline")
        fig.tight_layout()
        paths["plot_change"] = out_dir / "change.png"
        fig.savefig(paths["plot_change"], dpi=100)
        plt.close(fig)
    return paths


def _grids(rows: Sequence[EvalRow], configs: Sequence[EvalConfig], out_dir: Path) -> dict[str, Path]:
    """Per prompt, its images in a grid: a row per seed, a column per configuration."""
    paths = {}
    names = [c.name for c in configs]
    for prompt_index in sorted({r.prompt_index for r in rows}):
        mine = sorted(
            (r for r in rows if r.prompt_index == prompt_index), key=lambda r: (r.seed, names.index(r.config))
        )
        images = [Image.open(out_dir / row.image_path) for row in mine]
        labels = [f"{row.config} s{row.seed}\n{row.seconds:.1f} s" for row in mine]
        path = out_dir / "grids" / f"prompt_{prompt_index:03d}.png"
        paths[f"grid_{prompt_index:03d}"] = save_grid(images, labels, path, columns=len(names))
    return paths
