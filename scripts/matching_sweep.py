"""Global against window matching on the shipped trained models: the sweep behind the presets (docs/options.md).

Prints, per trained model, the noise-prediction change (and, on the video model, the flicker) of each setting with
`matching="global"` (tomesd's) and `matching="window"`, from `probe_quality` (four noise levels, held-out crops or
clips). Deterministic; about ten minutes on one thread.

    $ python scripts/matching_sweep.py            # every model
    $ python scripts/matching_sweep.py flux video
"""

from __future__ import annotations

import sys

import torch

from tome_processors import ToMeConfig
from tome_processors.bench.quality import probe_quality

# Per trained model: the family whose defaults the settings start from, and the settings.
SWEEPS: dict[str, tuple[str, list[dict]]] = {
    "flux": (
        "flux",
        [
            {"ratio": 0.3},
            {"ratio": 0.5},
            {"ratio": 0.5, "share_level": True},
            {"ratio": 0.6, "share_level": True},
            {"ratio": 0.7},
            {"ratio": 0.7, "share_level": True},
            {"ratio": 0.4, "merge_mlp": True, "share_level": True},
            {"ratio": 0.5, "merge_mlp": True, "share_level": True},
        ],
    ),
    "video": (
        "wan",
        [
            {"ratio": 0.5},
            {"ratio": 0.7},
            {"st": 2, "sx": 1, "sy": 1, "ratio": 0.5},
            {"st": 2, "sx": 1, "sy": 1, "ratio": 0.5, "share_level": True},
            {"st": 2, "ratio": 0.7},
            {"st": 2, "ratio": 0.7, "share_level": True},
            {"st": 2, "ratio": 0.75},
            {"st": 2, "ratio": 0.75, "share_level": True},
            {"st": 2, "ratio": 0.8},
            {"st": 2, "ratio": 0.85},
            {"st": 2, "ratio": 0.85, "share_level": True},
        ],
    ),
    "dit": ("pixart", [{"ratio": 0.5}, {"ratio": 0.5, "share_level": True}, {"ratio": 0.7}]),
}


def cell(row: dict) -> str:
    change = f"{100 * row['eps_rel_change']:.2f}"
    return f"{change} / {100 * row['flicker']:.2f}" if "flicker" in row else change


def main(models: list[str]) -> None:
    torch.set_num_threads(1)
    for model in models:
        family, settings = SWEEPS[model]
        what = "change % / flicker %" if model == "video" else "change %"
        print(f"\n{model} ({what})\n\n| setting | global | window |\n|---|---|---|")
        for options in settings:
            config = ToMeConfig.for_model(family).replace(**options)
            rows = [probe_quality(config.replace(matching=m), model) for m in ("global", "window")]
            label = ", ".join(f"{k}={v}" for k, v in options.items())
            print(f"| {label} | {cell(rows[0])} | {cell(rows[1])} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SWEEPS))
