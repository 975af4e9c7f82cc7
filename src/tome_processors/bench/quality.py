"""Quality of a merging method on small denoisers trained here, measured offline on held-out photos.

Random-weight models have no natural token redundancy, so how much a method changes their output says
little about how much it would change a trained model's. This module ships two small pixel-space DDPM
denoisers trained on photos bundled with scikit-image: `"unet"`, with the Stable Diffusion UNet structure
(`scripts/train_denoiser.py`), and `"dit"`, a PixArt-shaped diffusion transformer (`scripts/train_dit.py`).
On crops of photos neither saw, it measures:

- the PSNR of its x0 prediction at a few noise levels, with and without a method applied, and
- the relative change of its noise prediction against the unmerged model,
  `||eps_method - eps_base|| / ||eps_base||`.

`report()` is `tome-processors quality`; `trained_quality_metrics()` gives the bench its two trained-model
columns and `probe_quality()` measures one configuration, both with the very same probe.

Example:
    >>> from tome_processors import apply_tome, remove_tome
    >>> from tome_processors.bench.quality import QualityProbe
    >>> probe = QualityProbe.default()
    >>> row = probe.measure(lambda unet: apply_tome(unet, ratio=0.5), remove_tome)
    >>> sorted(row)[:3]
    ['eps_rel_change', 'eps_rel_change_t100', 'eps_rel_change_t300']
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import DDPMScheduler, PixArtTransformer2DModel, UNet2DConditionModel

from ..apply import apply_tome, remove_tome
from ..config import ToMeConfig
from ..families import Family
from .engine import Apply, Method, relative_error
from .methods import tomesd_patch

# The split is by whole photo: no crop of a held-out photo is ever seen in training.
# `cat` is the same photo as `chelsea`, so it is in neither list.
TRAIN_IMAGES: tuple[str, ...] = (
    "astronaut",
    "coffee",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "stereo_motorcycle",
    "brick",
    "grass",
    "gravel",
    "moon",
    "coins",
    "clock",
    "cell",
    "page",
    "text",
)
HELDOUT_IMAGES: tuple[str, ...] = ("chelsea", "rocket", "camera")

SHORT_SIDE = 256
"""Photos are downscaled (anti-aliased) so that their shorter side is at most this many pixels."""

CONTEXT_TOKENS = 8
CONTEXT_SEED = 1234
DEFAULT_TIMESTEPS: tuple[int, ...] = (100, 300, 500, 700)


@dataclass(frozen=True)
class Denoiser:
    """A shipped trained denoiser: its folder under `tome_processors/data/`, model class and report label."""

    folder: str
    model_class: type
    label: str


#: The shipped denoisers by name; `probe_quality(denoiser=...)` and `--denoiser` take these names.
DENOISERS: dict[str, Denoiser] = {
    "unet": Denoiser("denoiser", UNet2DConditionModel, "trained UNet denoiser"),
    "dit": Denoiser("dit_denoiser", PixArtTransformer2DModel, "trained PixArt-shaped DiT"),
}


def _denoiser(name: str) -> Denoiser:
    if name not in DENOISERS:
        raise ValueError(f"Expected denoiser among {sorted(DENOISERS)}, but got {name!r}.")
    return DENOISERS[name]


def denoiser_path(denoiser: str = "unet") -> Path:
    """The folder of a shipped denoiser (`config.json`, `diffusion_pytorch_model.safetensors`, ...).

    Example:
        >>> denoiser_path("dit").name
        'dit_denoiser'
    """
    return Path(str(resources.files("tome_processors") / "data" / _denoiser(denoiser).folder))


def load_denoiser(denoiser: str = "unet") -> tuple[torch.nn.Module, DDPMScheduler]:
    """A shipped denoiser in float32 and eval mode, with the noise schedule it was trained with (offline).

    Example:
        >>> model, scheduler = load_denoiser("dit")
        >>> type(model).__name__, scheduler.config.num_train_timesteps
        ('PixArtTransformer2DModel', 1000)
    """
    folder = denoiser_path(denoiser)
    model = _denoiser(denoiser).model_class.from_pretrained(folder, torch_dtype=torch.float32)
    return model.eval(), DDPMScheduler.from_pretrained(folder)


def context_dim(model: torch.nn.Module) -> int:
    """The width of the fixed context a shipped denoiser takes: its cross-attention (UNet) or caption width (DiT)."""
    if isinstance(model, PixArtTransformer2DModel):
        return int(model.config.caption_channels)
    return int(model.config.cross_attention_dim)


def predict_noise(model: torch.nn.Module, sample: torch.Tensor, timestep: int, context: torch.Tensor) -> torch.Tensor:
    """One forward of a denoiser at one timestep for the whole batch, called as its pipelines call it.

    Example:
        >>> model, _ = load_denoiser("dit")
        >>> x = torch.zeros(1, 3, 32, 32)
        >>> predict_noise(model, x, 500, context_embedding(1, context_dim(model))).shape
        torch.Size([1, 3, 32, 32])
    """
    if isinstance(model, PixArtTransformer2DModel):  # its timestep embedding wants one value per sample
        timesteps = torch.full((sample.shape[0],), timestep, device=sample.device)
        return model(sample, encoder_hidden_states=context, timestep=timesteps).sample
    return model(sample, torch.tensor(timestep), encoder_hidden_states=context).sample


def load_photo(name: str, short_side: int = SHORT_SIDE) -> torch.Tensor:
    """A scikit-image sample photo as a float tensor of shape [3, H, W] in [-1, 1].

    Grayscale photos are repeated on the three channels; photos whose shorter side is above
    `short_side` are downscaled (anti-aliased) so that it equals `short_side`.

    Example:
        >>> load_photo("chelsea").shape
        torch.Size([3, 256, 385])
    """
    import skimage.data
    from skimage.transform import rescale

    image = getattr(skimage.data, name)()
    if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
        image = image[0]
    image = np.asarray(image, dtype=np.float64) / 255.0
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    image = image[:, :, :3]
    scale = short_side / min(image.shape[:2])
    if scale < 1.0:
        image = rescale(image, scale, anti_aliasing=True, channel_axis=2, order=1)
    tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))).float()
    return tensor.clamp(0.0, 1.0) * 2.0 - 1.0


def context_embedding(batch: int = 1, dim: int = 32) -> torch.Tensor:
    """The fixed conditioning the denoiser is trained and measured with: [batch, 8, dim].

    The denoiser is unconditional in spirit; cross-attention still needs keys and values, so every
    sample gets the same 8 tokens drawn once from `CONTEXT_SEED`. Cross-attention then learns a
    position-dependent use of a constant context, as an SD UNet does with an empty prompt.

    Example:
        >>> context_embedding(2).shape
        torch.Size([2, 8, 32])
    """
    generator = torch.Generator().manual_seed(CONTEXT_SEED)
    tokens = torch.randn(1, CONTEXT_TOKENS, dim, generator=generator)
    return tokens.expand(batch, -1, -1).contiguous()


def heldout_crops(size: int = 64, per_image: int = 2, seed: int = 0) -> torch.Tensor:
    """`per_image` crops of `size` x `size` from each held-out photo, at positions drawn from `seed`.

    Returns a tensor of shape [len(HELDOUT_IMAGES) * per_image, 3, size, size] in [-1, 1].

    Example:
        >>> heldout_crops().shape
        torch.Size([6, 3, 64, 64])
    """
    generator = torch.Generator().manual_seed(seed)
    crops = []
    for name in HELDOUT_IMAGES:
        photo = load_photo(name)
        _, height, width = photo.shape
        for _ in range(per_image):
            top = int(torch.randint(height - size + 1, (1,), generator=generator))
            left = int(torch.randint(width - size + 1, (1,), generator=generator))
            crops.append(photo[:, top : top + size, left : left + size])
    return torch.stack(crops)


def psnr(estimate: torch.Tensor, target: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2), from the mean squared error over all pixels.

    Example:
        >>> round(psnr(torch.zeros(4), torch.full((4,), 0.2)), 2)
        20.0
    """
    mse = float((estimate.double() - target.double()).pow(2).mean())
    return float("inf") if mse == 0.0 else 10.0 * float(np.log10(4.0 / mse))


def _gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of [N, C, H, W] with reflected borders."""
    radius = max(1, int(3.0 * sigma + 0.5))
    offsets = torch.arange(-radius, radius + 1, dtype=images.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()
    channels = images.shape[1]
    padded = torch.nn.functional.pad(images, (radius, radius, radius, radius), mode="reflect")
    horizontal = kernel.view(1, 1, 1, -1).repeat(channels, 1, 1, 1)
    vertical = kernel.view(1, 1, -1, 1).repeat(channels, 1, 1, 1)
    out = torch.nn.functional.conv2d(padded, horizontal, groups=channels)
    return torch.nn.functional.conv2d(out, vertical, groups=channels)


BLUR_SIGMAS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Blur widths tried by the blur predictor; the best one per noise level is kept (an oracle choice)."""


class QualityProbe:
    """A denoiser, fixed held-out crops, fixed noise and noise levels: measures a method's effect.

    Every `measure` call runs the same inputs: the crops noised with the same noise at each timestep
    in `timesteps` (one forward per timestep, the crops as one batch, as in sampling). The
    unmerged model's noise prediction is computed once and kept as the reference.

    Args:
        model: a `UNet2DConditionModel` or `PixArtTransformer2DModel` predicting epsilon on [-1, 1]
            images (3 channels).
        alphas_cumprod: the noise schedule's cumulative alphas, indexed by timestep.
        crops: clean images [N, 3, H, W] in [-1, 1].
        timesteps: the noise levels to measure at.
        seed: seeds the noise.

    Example:
        >>> probe = QualityProbe.default()
        >>> base = probe.measure()
        >>> base["eps_rel_change"]
        0.0
    """

    def __init__(
        self,
        model: torch.nn.Module,
        alphas_cumprod: torch.Tensor,
        crops: torch.Tensor,
        timesteps: Sequence[int] = DEFAULT_TIMESTEPS,
        seed: int = 0,
    ) -> None:
        self.model = model.eval()
        self.crops = crops.float()
        self.timesteps = tuple(int(t) for t in timesteps)
        generator = torch.Generator().manual_seed(seed)
        self.noise = torch.randn((len(self.timesteps), *crops.shape), generator=generator)
        self.alphas = torch.stack([alphas_cumprod[t].float() for t in self.timesteps])
        a = self.alphas.view(-1, 1, 1, 1, 1)
        self.noisy = a.sqrt() * self.crops.unsqueeze(0) + (1.0 - a).sqrt() * self.noise
        self.context = context_embedding(crops.shape[0], context_dim(model))
        self._base: torch.Tensor | None = None

    @classmethod
    def default(
        cls,
        timesteps: Sequence[int] = DEFAULT_TIMESTEPS,
        per_image: int = 2,
        size: int = 64,
        seed: int = 0,
        random_weights: bool = False,
        denoiser: str = "unet",
    ) -> QualityProbe:
        """A shipped denoiser (`"unet"` or `"dit"`, loaded offline) on `per_image` crops of each held-out photo.

        With `random_weights=True` the same architecture is freshly initialised from `seed` instead:
        the random-weight reference, whose PSNR means nothing but whose noise-prediction change can
        be set against the trained model's.

        Example:
            >>> probe = QualityProbe.default(timesteps=(100, 500), denoiser="dit")
            >>> probe.crops.shape
            torch.Size([6, 3, 64, 64])
        """
        model, scheduler = load_denoiser(denoiser)
        if random_weights:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = type(model).from_config(model.config)
        return cls(model, scheduler.alphas_cumprod, heldout_crops(size, per_image, seed), timesteps, seed)

    def predict_eps(self) -> torch.Tensor:
        """The model's noise prediction at every timestep: [len(timesteps), N, 3, H, W]."""
        with torch.no_grad():
            outputs = [
                predict_noise(self.model, self.noisy[index], timestep, self.context).float()
                for index, timestep in enumerate(self.timesteps)
            ]
        return torch.stack(outputs)

    def x0_from_eps(self, eps: torch.Tensor) -> torch.Tensor:
        """The clean-image estimate `(x_t - sqrt(1 - a) eps) / sqrt(a)`, clamped to [-1, 1]."""
        a = self.alphas.view(-1, 1, 1, 1, 1)
        return ((self.noisy - (1.0 - a).sqrt() * eps) / a.sqrt()).clamp(-1.0, 1.0)

    def baseline(self) -> torch.Tensor:
        """The unmerged model's noise prediction (computed once)."""
        if self._base is None:
            self._base = self.predict_eps()
        return self._base

    def measure(
        self,
        apply: Callable[[torch.nn.Module], object] | None = None,
        remove: Callable[[torch.nn.Module], object] | None = None,
    ) -> dict[str, float]:
        """Apply a method, predict, remove it; return its quality as a flat dict of floats.

        Keys: `psnr` (x0 PSNR in dB, averaged over the timesteps), `psnr_drop` (the unmerged model's
        minus this), `eps_rel_change` (`||eps - eps_base|| / ||eps_base||` over all timesteps), and
        `psnr_t{t}` / `eps_rel_change_t{t}` per timestep. `remove` runs even if the forward fails.

        Example:
            >>> from tome_processors import apply_tome, remove_tome
            >>> row = probe.measure(lambda unet: apply_tome(unet, ratio=0.5), remove_tome)  # doctest: +SKIP
            >>> row["eps_rel_change"], row["psnr_drop"]  # doctest: +SKIP
        """
        base = self.baseline()
        if apply is None:
            eps = base
        else:
            apply(self.model)
            try:
                eps = self.predict_eps()
            finally:
                if remove is not None:
                    remove(self.model)
        x0, x0_base = self.x0_from_eps(eps), self.x0_from_eps(base)
        row: dict[str, float] = {}
        psnrs, base_psnrs = [], []
        for index, timestep in enumerate(self.timesteps):
            value = psnr(x0[index], self.crops)
            psnrs.append(value)
            base_psnrs.append(psnr(x0_base[index], self.crops))
            row[f"psnr_t{timestep}"] = value
            row[f"eps_rel_change_t{timestep}"] = relative_error(eps[index], base[index])
        row["psnr"] = float(np.mean(psnrs))
        row["psnr_drop"] = float(np.mean(base_psnrs) - np.mean(psnrs))
        row["eps_rel_change"] = relative_error(eps, base)
        return dict(sorted(row.items()))

    def trivial_psnr(self) -> dict[str, dict[int, float]]:
        """x0 PSNR of predictors that need no model, per timestep, to set the model's against.

        - `zero_eps`: predict eps = 0, so x0 = x_t / sqrt(alpha_bar);
        - `mean`: each crop's per-channel mean of x_t / sqrt(alpha_bar) everywhere;
        - `blur`: x_t / sqrt(alpha_bar) under a Gaussian blur, with the width from `BLUR_SIGMAS`
          that scores best at that timestep on these very crops (an oracle choice, so a strong baseline).

        Example:
            >>> sorted(probe.trivial_psnr())  # doctest: +SKIP
            ['blur', 'mean', 'zero_eps']
        """
        scaled = self.noisy / self.alphas.sqrt().view(-1, 1, 1, 1, 1)
        table: dict[str, dict[int, float]] = {"zero_eps": {}, "mean": {}, "blur": {}}
        for index, timestep in enumerate(self.timesteps):
            image = scaled[index]
            table["zero_eps"][timestep] = psnr(image.clamp(-1.0, 1.0), self.crops)
            mean = image.mean(dim=(2, 3), keepdim=True).expand_as(image)
            table["mean"][timestep] = psnr(mean.clamp(-1.0, 1.0), self.crops)
            blurred = [psnr(_gaussian_blur(image, s).clamp(-1.0, 1.0), self.crops) for s in BLUR_SIGMAS]
            table["blur"][timestep] = max(blurred)
        return table


class _NoAttention:
    """An attention processor that contributes nothing (the block keeps only its residual)."""

    def __call__(
        self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def _without_self_attention(prefixes: Callable[[torch.nn.Module], tuple[str, ...]]) -> tuple[Apply, Apply]:
    """A reference, not a method: the self-attention of the modules named with `prefixes(model)` removed."""
    saved: dict[str, object] = {}

    def apply(model: torch.nn.Module) -> None:
        saved.update(model.attn_processors)
        for name, module in model.named_modules():
            if name.endswith(".attn1") and name.startswith(prefixes(model)):
                module.set_processor(_NoAttention())

    def remove(model: torch.nn.Module) -> None:
        model.set_attn_processor(dict(saved))
        saved.clear()

    return apply, remove


def _unet_top_level(unet: torch.nn.Module) -> tuple[str, ...]:
    return ("down_blocks.0.", f"up_blocks.{len(unet.up_blocks) - 1}.")


def _every_block(model: torch.nn.Module) -> tuple[str, ...]:
    return ("transformer_blocks.",)


def reference_methods(denoiser: str = "unet") -> dict[str, tuple[Apply, Apply]]:
    """Named (apply, remove) pairs measured by `tome-processors quality` on one shipped denoiser.

    On the UNet, tomesd is included when it is installed (it is a test dependency); on the DiT, the
    PixArt family's default configuration (`apply_tome(model)` without options) is. The last entry is a
    reference, not a method: self-attention switched off (the UNet's top level; every DiT block), to show
    how much the model relies on the attention that merging approximates.

    Example:
        >>> "tome r=0.5" in reference_methods("dit")
        True
    """

    def tome(**options: object) -> tuple[Apply, Apply]:
        return (lambda model: apply_tome(model, **options)), remove_tome

    _denoiser(denoiser)
    if denoiser == "dit":
        default = ToMeConfig.for_model("pixart").ratio
        return {
            "tome r=0.3": tome(ratio=0.3),
            f"tome PixArt default (r={default:g})": tome(),
            "tome r=0.5": tome(ratio=0.5),
            "tome r=0.7": tome(ratio=0.7),
            "tome r=0.75": tome(ratio=0.75),
            "tome r=0.5 use_rand=False": tome(ratio=0.5, use_rand=False),
            "tome r=0.5 share_level": tome(ratio=0.5, share_level=True),
            "tome r=0.5 merge_mlp": tome(ratio=0.5, merge_mlp=True),
            "downsample_kv avg": tome(mode="downsample_kv"),
            "downsample_kv nearest": tome(mode="downsample_kv", kv_pool="nearest"),
            "reference: no self-attention in any block": _without_self_attention(_every_block),
        }
    methods = {
        "tome r=0.3": tome(ratio=0.3),
        "tome r=0.5": tome(ratio=0.5),
        "tome r=0.75": tome(ratio=0.75),
        "tome r=0.5 use_rand=False": tome(ratio=0.5, use_rand=False),
        "tome r=0.5 share_level": tome(ratio=0.5, share_level=True),
        "tome r=0.5 merge_mlp": tome(ratio=0.5, merge_mlp=True),
        "downsample_kv avg": tome(mode="downsample_kv"),
        "downsample_kv nearest": tome(mode="downsample_kv", kv_pool="nearest"),
    }
    try:
        methods["tomesd r=0.5"] = tomesd_patch(0.5)
    except ImportError:
        pass
    methods["reference: no top-level self-attention"] = _without_self_attention(_unet_top_level)
    return methods


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for rank, index in enumerate(order, start=1):
        ranks[index] = rank
    return ranks


def report(
    per_image: int = 2, seed: int = 0, timesteps: Sequence[int] = DEFAULT_TIMESTEPS, denoiser: str = "unet"
) -> str:
    """A markdown report on one shipped denoiser (`"unet"` or `"dit"`): the model against trivial predictors,
    and every reference method measured on the trained model and on the same architecture with random weights.

    Example:
        >>> print(report(denoiser="dit"))  # doctest: +SKIP
    """
    probe = QualityProbe.default(timesteps, per_image=per_image, seed=seed, denoiser=denoiser)
    random_probe = QualityProbe.default(
        timesteps, per_image=per_image, seed=seed, random_weights=True, denoiser=denoiser
    )
    base = probe.measure()
    trivial = probe.trivial_psnr()
    steps, alphas = probe.timesteps, probe.alphas.tolist()
    lines = [
        f"### {DENOISERS[denoiser].label} (`tome_processors/data/{DENOISERS[denoiser].folder}`)",
        "",
        f"Held-out crops: {probe.crops.shape[0]} of {probe.crops.shape[-2]}x{probe.crops.shape[-1]} "
        f"from {', '.join(HELDOUT_IMAGES)}; seed {seed}.",
        "",
        "x0 PSNR (dB) by timestep (alpha_bar in brackets):",
        "",
        "| predictor | " + " | ".join(f"t={t} ({float(a):.3f})" for t, a in zip(steps, alphas, strict=True)) + " |",
        "|---|" + "---:|" * len(steps),
        "| trained denoiser | " + " | ".join(f"{base[f'psnr_t{t}']:.2f}" for t in steps) + " |",
    ]
    for name, values in trivial.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[t]:.2f}" for t in steps) + " |")
    lines.append(
        "| margin over best trivial | "
        + " | ".join(f"{base[f'psnr_t{t}'] - max(v[t] for v in trivial.values()):+.2f}" for t in steps)
        + " |"
    )
    names, trained, random = [], [], []
    for name, (apply, remove) in reference_methods(denoiser).items():
        names.append(name)
        trained.append(probe.measure(apply, remove))
        random.append(random_probe.measure(apply, remove))
    trained_rank = _ranks([row["eps_rel_change"] for row in trained])
    random_rank = _ranks([row["eps_rel_change"] for row in random])
    lines += [
        "",
        "Methods: relative change of the noise prediction against the unmerged model (rank 1 = smallest), "
        f"and x0 PSNR drop (dB, mean over t; unmerged model {base['psnr']:.2f} dB):",
        "",
        "| method | trained eps change | rank | PSNR drop | worst-t PSNR drop | random-weight eps change | rank |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, name in enumerate(names):
        worst = max(base[f"psnr_t{t}"] - trained[i][f"psnr_t{t}"] for t in steps)
        lines.append(
            f"| {name} | {trained[i]['eps_rel_change']:.4f} | {trained_rank[i]} | {trained[i]['psnr_drop']:+.3f} "
            f"| {worst:+.3f} | {random[i]['eps_rel_change']:.4f} | {random_rank[i]} |"
        )
    return "\n".join(lines)


#: Bench column: relative change of the trained UNet denoiser's noise prediction, in percent.
TRAINED_EPS_CHANGE = "trained eps change %"
#: Bench column: drop of the UNet's x0 PSNR on held-out crops, in dB (positive = worse than unmerged).
TRAINED_PSNR_DROP = "trained PSNR drop dB"
#: The same two columns measured on the trained DiT, for the bench's transformer rows.
DIT_EPS_CHANGE = "trained DiT eps change %"
DIT_PSNR_DROP = "trained DiT PSNR drop dB"
#: Denoiser name -> the bench's (eps change, PSNR drop) columns measured on it.
TRAINED_COLUMNS: dict[str, tuple[str, str]] = {
    "unet": (TRAINED_EPS_CHANGE, TRAINED_PSNR_DROP),
    "dit": (DIT_EPS_CHANGE, DIT_PSNR_DROP),
}


def bench_denoiser(family: Family | str | None) -> str:
    """The shipped denoiser that measures a model family (a `Family` or its name): `"dit"` for diffusion
    transformers (PixArt, SD3, Flux are measured on the PixArt-shaped DiT), else `"unet"` (also for Stable
    Video Diffusion, whose spatial blocks merge each frame as a UNet's blocks merge an image).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> bench_denoiser(FAMILIES["flux"]()), bench_denoiser("sd3"), bench_denoiser(None)
        ('dit', 'dit', 'unet')
    """
    name = family if family is None or isinstance(family, str) else family.name
    return "unet" if name in (None, "unet", "svd") else "dit"


def trained_quality_metrics(denoiser: str = "unet", **probe_options: Any) -> Callable[[Method], dict[str, float]]:
    """A bench `extra_metrics` callable that measures each method on a shipped trained denoiser.

    Random-weight models have no natural token redundancy, so their output error can rank methods
    differently from a trained model. The probe (`QualityProbe.default(denoiser=denoiser, **probe_options)`:
    the denoiser, held-out crops, fixed noise) is loaded once; each call applies the method to the
    denoiser, measures how much it changes the noise prediction and lowers the x0 PSNR, and removes it
    again. The columns are `TRAINED_COLUMNS[denoiser]`. A method's `apply` must accept that model: the
    bench's transformer rows are `apply_tome` with a `ToMeConfig`, and the PixArt family takes every
    option (SD3 and Flux rows are merge-only, which PixArt takes too).

    Example:
        >>> from tome_processors.bench.methods import baseline_method
        >>> metrics = trained_quality_metrics("dit", timesteps=(500,))
        >>> metrics(baseline_method())[DIT_EPS_CHANGE]
        0.0
    """
    _denoiser(denoiser)
    eps_column, psnr_column = TRAINED_COLUMNS[denoiser]
    probe = QualityProbe.default(denoiser=denoiser, **probe_options)

    def metrics(method: Method) -> dict[str, float]:
        measured = probe.measure(method.apply, method.remove)
        return {eps_column: 100.0 * measured["eps_rel_change"], psnr_column: measured["psnr_drop"]}

    return metrics


@functools.lru_cache(maxsize=4)
def _shared_probe(denoiser: str, timesteps: tuple[int, ...], per_image: int, size: int, seed: int) -> QualityProbe:
    # One probe per setting: the model loads and its unmerged prediction is computed once per process.
    return QualityProbe.default(timesteps, per_image=per_image, size=size, seed=seed, denoiser=denoiser)


def probe_quality(
    method: ToMeConfig | Mapping[str, Any] | Method | None = None,
    denoiser: str = "dit",
    *,
    timesteps: Sequence[int] = DEFAULT_TIMESTEPS,
    per_image: int = 2,
    size: int = 64,
    seed: int = 0,
) -> dict[str, float]:
    """How much one configuration changes a shipped trained denoiser on held-out crops (`QualityProbe.measure`).

    Args:
        method: a `ToMeConfig` (applied as it is), a mapping of `apply_tome` options (`{}`: the family's
            defaults), a bench `Method`, or None (the unmerged model: every change is 0).
        denoiser: `"dit"` (the PixArt-shaped transformer) or `"unet"`.
        timesteps, per_image, size, seed: the probe (`QualityProbe.default`); one probe per setting is
            kept for the process, so repeated calls reuse the loaded model and its unmerged prediction.

    Returns:
        `psnr`, `psnr_drop` (dB), `eps_rel_change` (relative, not percent), and the per-timestep
        `psnr_t{t}` / `eps_rel_change_t{t}`.

    Example:
        >>> row = probe_quality(ToMeConfig(ratio=0.5), "dit", timesteps=(300,))
        >>> 0.0 < row["eps_rel_change"] < 1.0
        True
    """
    probe = _shared_probe(denoiser, tuple(int(t) for t in timesteps), per_image, size, seed)
    if method is None:
        return probe.measure()
    if isinstance(method, Method):
        return probe.measure(method.apply, method.remove)
    if isinstance(method, ToMeConfig):
        config = method
        return probe.measure(lambda model: apply_tome(model, config), remove_tome)
    options = dict(method)
    return probe.measure(lambda model: apply_tome(model, **options), remove_tome)
