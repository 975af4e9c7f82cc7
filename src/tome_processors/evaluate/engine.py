"""Quality against speed on real prompts: the engine behind `tome-processors eval`.

For every prompt and seed, an image is generated with the baseline and with each ToMe
configuration from the same generator seed. Each image gets a CLIP score (when a CLIP model is
given), its change against the baseline image of the same prompt and seed (PSNR, SSIM) and the
seconds it took. Work is spread over processes with accelerate's `PartialState` (one process by
default; `accelerate launch` for more), and the main process gathers the rows and writes CSV, JSON,
a markdown report with plots, and a labelled grid per prompt.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import CLIPModel, CLIPProcessor

from ..apply import apply_tome, remove_tome
from ..bench.generate import generate_image
from ..config import ToMeConfig

BASELINE = "baseline"


def default_prompts() -> list[str]:
    """The prompt list shipped with the package, one prompt per line."""
    text = resources.files("tome_processors").joinpath("data/prompts.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def load_prompts(path: str | Path | None) -> list[str]:
    """Prompts from a text file (one per line, blank lines and `#` comments skipped), or the default list."""
    if path is None:
        return default_prompts()
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"Expected at least one prompt in {path}, but got none.")
    return prompts


@dataclass(frozen=True)
class EvalConfig:
    """One column of the evaluation: a name and the ToMe configuration (None for the baseline)."""

    name: str
    tome: ToMeConfig | None = None


def eval_configs(ratios: Sequence[float], **options: Any) -> list[EvalConfig]:
    """The baseline followed by ToMe at each ratio (with shared `options`, e.g. `mode=`)."""
    configs = [EvalConfig(BASELINE)]
    for ratio in ratios:
        config = ToMeConfig(ratio=float(ratio), **options)
        suffix = "" if config.mode == "merge" else f" {config.mode}"
        configs.append(EvalConfig(f"tome {ratio:g}{suffix}", config))
    return configs


@dataclass
class EvalRow:
    """One generated image and its measurements."""

    prompt_index: int
    prompt: str
    seed: int
    config: str
    ratio: float
    seconds: float
    clip_score: float | None
    psnr: float | None
    ssim: float | None
    image_path: str
    process: int = 0


@dataclass
class EvalSettings:
    """What to generate. `height`/`width` None use the pipeline's defaults."""

    prompts: list[str]
    seeds: list[int]
    configs: list[EvalConfig]
    steps: int = 20
    guidance_scale: float = 7.5
    height: int | None = None
    width: int | None = None
    extra_call_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("Expected at least one prompt, but got none.")
        if not self.seeds:
            raise ValueError("Expected at least one seed, but got none.")
        if not self.configs or self.configs[0].tome is not None:
            raise ValueError("Expected the baseline as the first configuration.")
        if self.steps < 1:
            raise ValueError(f"Expected steps >= 1, but got {self.steps}.")


class ClipScorer:
    """CLIP score of an image against its prompt: `100 * max(cos(image, text), 0)`.

    Args:
        model_path: a local folder or hub id of a transformers CLIP model with its processor.

    Example:
        >>> scorer = ClipScorer("openai/clip-vit-large-patch14")  # doctest: +SKIP
        >>> scorer(image, "a cat")  # doctest: +SKIP
        31.2
    """

    def __init__(self, model_path: str, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = CLIPModel.from_pretrained(model_path).to(self.device).eval()
        self.processor = CLIPProcessor.from_pretrained(model_path)

    @torch.no_grad()
    def __call__(self, image: Any, prompt: str) -> float:
        inputs = self.processor(text=[prompt], images=[image], return_tensors="pt", padding=True, truncation=True)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        image_embeds = self.model.get_image_features(pixel_values=inputs["pixel_values"])
        text_embeds = self.model.get_text_features(
            input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask")
        )
        image_embeds = _as_tensor(image_embeds)
        text_embeds = _as_tensor(text_embeds)
        cosine = torch.nn.functional.cosine_similarity(image_embeds, text_embeds).item()
        return 100.0 * max(cosine, 0.0)


def _as_tensor(features: Any) -> torch.Tensor:
    # transformers may return a model output with the pooled embedding instead of a tensor.
    if isinstance(features, torch.Tensor):
        return features
    for name in ("image_embeds", "text_embeds", "pooler_output"):
        value = getattr(features, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"Expected CLIP features as a tensor, but got {type(features).__name__}.")


def image_change(image: Any, reference: Any) -> tuple[float, float]:
    """(PSNR in dB, SSIM) of `image` against `reference`, both PIL images or uint8 arrays.

    Identical images have infinite PSNR, reported as `math.inf`.
    """
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    a, b = np.asarray(image), np.asarray(reference)
    if a.shape != b.shape:
        raise ValueError(f"Expected images of the same shape, but got {a.shape} and {b.shape}.")
    psnr = math.inf if np.array_equal(a, b) else float(peak_signal_noise_ratio(b, a, data_range=255))
    ssim = float(structural_similarity(b, a, data_range=255, channel_axis=-1 if a.ndim == 3 else None))
    return psnr, ssim


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in name)


def run_eval(
    pipe: Any,
    settings: EvalSettings,
    out_dir: str | Path,
    clip_scorer: Callable[[Any, str], float] | None = None,
    state: Any = None,
    progress: bool = True,
) -> list[EvalRow]:
    """Generate and measure this process's share of `(prompt, seed)` pairs; gather on the main process.

    Args:
        pipe: a diffusers text-to-image pipeline with a `unet` (or `transformer`).
        settings: prompts, seeds, configurations and generation options.
        out_dir: where images are saved (`images/<config>/p<prompt>_s<seed>.png`).
        clip_scorer: scores an image against its prompt; None leaves the column empty.
        state: an accelerate `PartialState`; a new one by default.

    Returns:
        All rows on the main process (gathered from every process), this process's rows elsewhere.
    """
    state = state or PartialState(cpu=not torch.cuda.is_available())
    out_dir = Path(out_dir)
    items = [(p, seed) for p in range(len(settings.prompts)) for seed in settings.seeds]
    rows: list[EvalRow] = []
    with state.split_between_processes(items) as my_items:
        bar = tqdm(
            list(my_items),
            desc=f"eval[{state.process_index}]",
            disable=not progress or not state.is_local_main_process,
        )
        for prompt_index, seed in bar:
            rows.extend(_measure_item(pipe, settings, out_dir, clip_scorer, prompt_index, seed, state.process_index))
    remove_tome(pipe)
    if state.num_processes > 1:
        gathered = gather_object([asdict(row) for row in rows])
        rows = [EvalRow(**row) for row in gathered]
    return sorted(rows, key=lambda r: (r.prompt_index, r.seed, [c.name for c in settings.configs].index(r.config)))


def _measure_item(
    pipe: Any,
    settings: EvalSettings,
    out_dir: Path,
    clip_scorer: Callable[[Any, str], float] | None,
    prompt_index: int,
    seed: int,
    process: int,
) -> list[EvalRow]:
    prompt = settings.prompts[prompt_index]
    rows, reference = [], None
    for config in settings.configs:
        if config.tome is None:
            remove_tome(pipe)
        else:
            apply_tome(pipe, config.tome)
        image, seconds = generate_image(
            pipe,
            prompt,
            seed,
            settings.steps,
            settings.guidance_scale,
            settings.height,
            settings.width,
            **settings.extra_call_kwargs,
        )
        path = out_dir / "images" / _slug(config.name) / f"p{prompt_index:03d}_s{seed}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
        psnr = ssim = None
        if reference is None:
            reference = image
        else:
            psnr, ssim = image_change(image, reference)
        rows.append(
            EvalRow(
                prompt_index=prompt_index,
                prompt=prompt,
                seed=seed,
                config=config.name,
                ratio=0.0 if config.tome is None else config.tome.ratio,
                seconds=seconds,
                clip_score=None if clip_scorer is None else clip_scorer(image, prompt),
                psnr=psnr,
                ssim=ssim,
                image_path=str(path.relative_to(out_dir)),
                process=process,
            )
        )
    return rows


def summarize(rows: Sequence[EvalRow], configs: Sequence[EvalConfig]) -> list[dict[str, Any]]:
    """One summary per configuration: image count and mean / median of each measurement."""
    summary = []
    for config in configs:
        mine = [r for r in rows if r.config == config.name]
        entry: dict[str, Any] = {"config": config.name, "images": len(mine)}
        entry["ratio"] = 0.0 if config.tome is None else config.tome.ratio
        for metric in ("seconds", "clip_score", "psnr", "ssim"):
            values = [getattr(r, metric) for r in mine if getattr(r, metric) is not None]
            finite = [v for v in values if math.isfinite(v)]
            entry[f"{metric}_mean"] = statistics.fmean(finite) if finite else None
            entry[f"{metric}_median"] = statistics.median(finite) if finite else None
        summary.append(entry)
    base = summary[0]["seconds_median"]
    for entry in summary:
        entry["speedup"] = base / entry["seconds_median"] if base and entry["seconds_median"] else None
    return summary
