"""Quality of a merging method on small denoisers trained here, measured offline on held-out photos.

Random-weight models have no natural token redundancy, so how much a method changes their output says
little about how much it would change a trained model's. This module ships four small pixel-space DDPM
denoisers trained on photos bundled with scikit-image (`DENOISERS`): `"unet"`, with the Stable Diffusion
UNet structure (`scripts/train_denoiser.py`), `"dit"`, a PixArt-shaped diffusion transformer
(`scripts/train_dit.py`), `"flux"`, a FLUX-shaped one with joint text-image attention and rotary positions
(`scripts/train_flux.py`), and `"video"`, a Wan-shaped video transformer trained on clips made from the
photos (`scripts/train_video.py`, `clips.py`). On crops (clips) of photos none saw, it measures:

- the PSNR of its x0 prediction at a few noise levels, with and without a method applied,
- the relative change of its noise prediction against the unmerged model,
  `||eps_method - eps_base|| / ||eps_base||`, and on clips its flicker (the same for the prediction's
  frame-to-frame differences).

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
from diffusers import (
    DDPMScheduler,
    FluxTransformer2DModel,
    PixArtTransformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)

from ..apply import apply_tome, remove_tome
from ..config import ToMeConfig
from ..families import FAMILIES, Family
from ..pays import ALWAYS, pays_table
from .clips import CLIP_SIZE, MOTIONS, heldout_clips
from .engine import Apply, Method, relative_error
from .methods import tomesd_patch
from .photos import HELDOUT_IMAGES, heldout_crops

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
    "flux": Denoiser("flux_denoiser", FluxTransformer2DModel, "trained FLUX-shaped joint-attention rotary DiT"),
    "video": Denoiser("video_denoiser", WanTransformer3DModel, "trained Wan-shaped video DiT"),
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


def heldout_samples(denoiser: str, per_image: int = 2, size: int | None = None, seed: int = 0) -> torch.Tensor:
    """What a shipped denoiser is measured on: held-out crops `[N, 3, size, size]` (`size` default 64), or
    held-out clips `[N, 3, F, size, size]` for the video denoiser (`size` default 32, `per_image` per motion).

    Example:
        >>> heldout_samples("video", per_image=1).shape
        torch.Size([9, 3, 8, 32, 32])
    """
    if _denoiser(denoiser).model_class is WanTransformer3DModel:
        return heldout_clips(size=size or CLIP_SIZE, per_image=per_image, seed=seed)
    return heldout_crops(size or 64, per_image, seed)


def context_dim(model: torch.nn.Module) -> int:
    """The width of the fixed context a shipped denoiser takes: its cross-attention (UNet), caption (DiT),
    joint-attention (FLUX) or text (video) width."""
    if isinstance(model, PixArtTransformer2DModel):
        return int(model.config.caption_channels)
    if isinstance(model, FluxTransformer2DModel):
        return int(model.config.joint_attention_dim)
    if isinstance(model, WanTransformer3DModel):
        return int(model.config.text_dim)
    return int(model.config.cross_attention_dim)


PACK = 2
"""The FLUX-shaped denoiser takes 2x2 pixel patches as tokens, as FLUX's pipelines pack 2x2 latent pixels."""


def pack_image(images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C] row-major tokens, as FLUX's pipelines pack latents.

    Example:
        >>> pack_image(torch.zeros(1, 3, 8, 6)).shape
        torch.Size([1, 12, 12])
    """
    b, c, h, w = images.shape
    patches = images.reshape(b, c, h // PACK, PACK, w // PACK, PACK).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // PACK) * (w // PACK), c * PACK * PACK)


def unpack_tokens(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_image` for images of `height` x `width` pixels.

    Example:
        >>> x = torch.randn(2, 3, 8, 6)
        >>> torch.equal(unpack_tokens(pack_image(x), 8, 6), x)
        True
    """
    b, _, channels = tokens.shape
    c = channels // (PACK * PACK)
    patches = tokens.reshape(b, height // PACK, width // PACK, c, PACK, PACK).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height, width)


def image_ids(height: int, width: int) -> torch.Tensor:
    """FLUX's image position ids for `height` x `width` pixels of 2x2 patches: [N, 3] = (0, row, column).

    Example:
        >>> image_ids(4, 6).tolist()[:4]
        [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 2.0], [0.0, 1.0, 0.0]]
    """
    rows, cols = height // PACK, width // PACK
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


def predict_noise(
    model: torch.nn.Module, sample: torch.Tensor, timestep: int | torch.Tensor, context: torch.Tensor
) -> torch.Tensor:
    """One forward of a denoiser for the whole batch, called as its pipelines call it.

    `sample` is `[B, 3, H, W]` (a clip `[B, 3, F, H, W]` for the video denoiser); `timestep` one DDPM
    timestep for the batch or one per sample. Returns the noise prediction in `sample`'s shape.

    Example:
        >>> model, _ = load_denoiser("dit")
        >>> x = torch.zeros(1, 3, 32, 32)
        >>> predict_noise(model, x, 500, context_embedding(1, context_dim(model))).shape
        torch.Size([1, 3, 32, 32])
    """
    timesteps = torch.as_tensor(timestep, device=sample.device).expand(sample.shape[0])
    if isinstance(model, PixArtTransformer2DModel | WanTransformer3DModel):  # one timestep per sample
        return model(sample, encoder_hidden_states=context, timestep=timesteps).sample
    if isinstance(model, FluxTransformer2DModel):
        height, width = sample.shape[-2:]
        out = model(
            hidden_states=pack_image(sample),
            encoder_hidden_states=context,
            pooled_projections=context.mean(dim=1),
            timestep=timesteps.to(sample.dtype) / 1000,  # FLUX's pipelines pass t / 1000; the model scales back
            img_ids=image_ids(height, width).to(sample.device),
            txt_ids=torch.zeros(context.shape[1], 3, device=sample.device),
        ).sample
        return unpack_tokens(out, height, width)
    return model(sample, torch.as_tensor(timestep, device=sample.device), encoder_hidden_states=context).sample


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
        model: a shipped denoiser (`load_denoiser`) predicting epsilon on [-1, 1]
            images (3 channels).
        alphas_cumprod: the noise schedule's cumulative alphas, indexed by timestep.
        crops: clean images [N, 3, H, W] (or clips [N, 3, F, H, W]) in [-1, 1].
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
        a = self._per_timestep(self.alphas)
        self.noisy = a.sqrt() * self.crops.unsqueeze(0) + (1.0 - a).sqrt() * self.noise
        self.context = context_embedding(crops.shape[0], context_dim(model))
        self._base: torch.Tensor | None = None

    @classmethod
    def default(
        cls,
        timesteps: Sequence[int] = DEFAULT_TIMESTEPS,
        per_image: int = 2,
        size: int | None = None,
        seed: int = 0,
        random_weights: bool = False,
        denoiser: str = "unet",
    ) -> QualityProbe:
        """A shipped denoiser (a name of `DENOISERS`, loaded offline) on held-out samples: `per_image` crops of
        `size` x `size` (default 64) from each held-out photo, or for the video denoiser `per_image` clips of
        each motion per photo (`clips.heldout_clips`, frames of `size` default 32).

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
        return cls(model, scheduler.alphas_cumprod, heldout_samples(denoiser, per_image, size, seed), timesteps, seed)

    @property
    def is_video(self) -> bool:
        """Whether the samples are clips `[N, 3, F, H, W]` rather than images `[N, 3, H, W]`."""
        return self.crops.dim() == 5

    def _per_timestep(self, values: torch.Tensor) -> torch.Tensor:
        return values.view(-1, *[1] * self.crops.dim())  # broadcast over a stack of per-timestep batches

    def predict_eps(self) -> torch.Tensor:
        """The model's noise prediction at every timestep: [len(timesteps), *crops.shape]."""
        with torch.no_grad():
            outputs = [
                predict_noise(self.model, self.noisy[index], timestep, self.context).float()
                for index, timestep in enumerate(self.timesteps)
            ]
        return torch.stack(outputs)

    def x0_from_eps(self, eps: torch.Tensor) -> torch.Tensor:
        """The clean-image estimate `(x_t - sqrt(1 - a) eps) / sqrt(a)`, clamped to [-1, 1]."""
        a = self._per_timestep(self.alphas)
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
        On clips also `flicker`: the relative change of the prediction's frame-to-frame differences,
        `||d(eps) - d(eps_base)|| / ||d(eps_base)||` with `d` the difference of consecutive frames, which
        merges that differ from frame to frame move most.

        Example:
            >>> from tome_processors import apply_tome, remove_tome
            >>> row = probe.measure(lambda unet: apply_tome(unet, ratio=0.5), remove_tome)  # doctest: +SKIP
            >>> row["eps_rel_change"], row["psnr_drop"]  # doctest: +SKIP
        """
        base = self.baseline()
        eps = base if apply is None else run_where_it_merges(self.model, apply, remove, self.predict_eps)
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
        if self.is_video:
            row["flicker"] = relative_error(eps.diff(dim=-3), base.diff(dim=-3))
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
        scaled = self.noisy / self._per_timestep(self.alphas.sqrt())
        crops = self.crops
        if self.is_video:  # frame by frame: [N, 3, F, H, W] -> [N * F, 3, H, W]
            scaled = scaled.transpose(2, 3).flatten(1, 2)
            crops = crops.transpose(1, 2).flatten(0, 1)
        table: dict[str, dict[int, float]] = {"zero_eps": {}, "mean": {}, "blur": {}}
        for index, timestep in enumerate(self.timesteps):
            image = scaled[index]
            table["zero_eps"][timestep] = psnr(image.clamp(-1.0, 1.0), crops)
            mean = image.mean(dim=(2, 3), keepdim=True).expand_as(image)
            table["mean"][timestep] = psnr(mean.clamp(-1.0, 1.0), crops)
            blurred = [psnr(_gaussian_blur(image, s).clamp(-1.0, 1.0), crops) for s in BLUR_SIGMAS]
            table["blur"][timestep] = max(blurred)
        return table


class _NoAttention:
    """An attention processor that contributes nothing (the block keeps only its residual).

    Joint attention (text as `encoder_hidden_states`) returns nothing for the text stream too.
    """

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        *args: object,
        **kwargs: object,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is not None and getattr(attn, "add_q_proj", None) is not None:
            return torch.zeros_like(hidden_states), torch.zeros_like(encoder_hidden_states)
        return torch.zeros_like(hidden_states)


def _without_self_attention(
    prefixes: Callable[[torch.nn.Module], tuple[str, ...]], suffix: str = ".attn1"
) -> tuple[Apply, Apply]:
    """A reference, not a method: the self-attention of the modules named with `prefixes(model)` and ending
    in `suffix` removed."""
    saved: dict[str, object] = {}

    def apply(model: torch.nn.Module) -> None:
        saved.update(model.attn_processors)
        for name, module in model.named_modules():
            if name.endswith(suffix) and name.startswith(prefixes(model)):
                module.set_processor(_NoAttention())

    def remove(model: torch.nn.Module) -> None:
        model.set_attn_processor(dict(saved))
        saved.clear()

    return apply, remove


def _unet_top_level(unet: torch.nn.Module) -> tuple[str, ...]:
    return ("down_blocks.0.", f"up_blocks.{len(unet.up_blocks) - 1}.")


def _every_block(model: torch.nn.Module) -> tuple[str, ...]:
    return ("transformer_blocks.",)


def _every_flux_block(model: torch.nn.Module) -> tuple[str, ...]:
    return ("transformer_blocks.", "single_transformer_blocks.")


def _every_wan_block(model: torch.nn.Module) -> tuple[str, ...]:
    return ("blocks.",)


def _tome(**options: object) -> tuple[Apply, Apply]:
    return (lambda model: apply_tome(model, **options)), remove_tome


def _transformer_methods(family: str, label: str) -> dict[str, tuple[Apply, Apply]]:
    """The DiT's ratio sweep and options (ratio 0.5 unless named), with the family's defaults as a row."""
    default = ToMeConfig.for_model(family).ratio
    methods = {f"tome r={ratio:g}": _tome(ratio=ratio) for ratio in (0.3, 0.5, 0.7, 0.75)}
    methods[f"tome {label} default (r={default:g})"] = _tome()
    methods.update(
        {
            "tome r=0.5 use_rand=False": _tome(ratio=0.5, use_rand=False),
            "tome r=0.5 share_level": _tome(ratio=0.5, share_level=True),
            "tome r=0.5 merge_mlp": _tome(ratio=0.5, merge_mlp=True),
        }
    )
    return methods


def reference_methods(denoiser: str = "unet") -> dict[str, tuple[Apply, Apply]]:
    """Named (apply, remove) pairs measured by `tome-processors quality` on one shipped denoiser.

    On the UNet, tomesd is included when it is installed (it is a test dependency); on the transformers,
    the default configuration of the family the model is shaped like (`apply_tome(model)` without
    options) is; on the video model, merging across frames (`st=2`) too. The last entry is a reference, not
    a method: self-attention switched off (the UNet's top level; every block of a transformer), to show
    how much the model relies on the attention that merging approximates.

    Example:
        >>> "tome r=0.5" in reference_methods("dit")
        True
    """
    _denoiser(denoiser)
    if denoiser == "dit":
        return {
            **_transformer_methods("pixart", "PixArt"),
            "downsample_kv avg": _tome(mode="downsample_kv"),
            "downsample_kv nearest": _tome(mode="downsample_kv", kv_pool="nearest"),
            "reference: no self-attention in any block": _without_self_attention(_every_block),
        }
    if denoiser == "flux":
        return {
            **_transformer_methods("flux", "Flux"),
            "reference: no attention in any block": _without_self_attention(_every_flux_block, ".attn"),
        }
    if denoiser == "video":
        return {
            **_transformer_methods("wan", "Wan"),
            "tome st=2 r=0.5": _tome(st=2),
            "tome st=2 1x1 r=0.5": _tome(st=2, sx=1, sy=1),
            "tome st=2 r=0.7": _tome(st=2, ratio=0.7),
            "tome st=2 1x1 r=0.5 share_level": _tome(st=2, sx=1, sy=1, share_level=True),
            "reference: no self-attention in any block": _without_self_attention(_every_wan_block),
        }
    methods = {
        "tome r=0.3": _tome(ratio=0.3),
        "tome r=0.5": _tome(ratio=0.5),
        "tome r=0.75": _tome(ratio=0.75),
        "tome r=0.5 use_rand=False": _tome(ratio=0.5, use_rand=False),
        "tome r=0.5 share_level": _tome(ratio=0.5, share_level=True),
        "tome r=0.5 merge_mlp": _tome(ratio=0.5, merge_mlp=True),
        "downsample_kv avg": _tome(mode="downsample_kv"),
        "downsample_kv nearest": _tome(mode="downsample_kv", kv_pool="nearest"),
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
    """A markdown report on one shipped denoiser (a name of `DENOISERS`): the model against trivial predictors,
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
    side = f"{probe.crops.shape[-2]}x{probe.crops.shape[-1]}"
    samples = (
        f"Held-out clips: {probe.crops.shape[0]} of {probe.crops.shape[2]} frames of {side} "
        f"({per_image} per motion: {', '.join(MOTIONS)}) from {', '.join(HELDOUT_IMAGES)}; seed {seed}."
        if probe.is_video
        else f"Held-out crops: {probe.crops.shape[0]} of {side} from {', '.join(HELDOUT_IMAGES)}; seed {seed}."
    )
    lines = [
        f"### {DENOISERS[denoiser].label} (`tome_processors/data/{DENOISERS[denoiser].folder}`)",
        "",
        samples,
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
    flicker = " flicker |" if probe.is_video else ""
    lines += [
        "",
        "Methods: relative change of the noise prediction against the unmerged model (rank 1 = smallest), "
        f"and x0 PSNR drop (dB, mean over t; unmerged model {base['psnr']:.2f} dB)"
        + (", and flicker (relative change of the prediction's frame-to-frame differences)" if flicker else "")
        + ":",
        "",
        "| method | trained eps change | rank | PSNR drop | worst-t PSNR drop |"
        + flicker
        + " random-weight eps change | rank |",
        "|---|---:|---:|---:|---:|" + ("---:|" if flicker else "") + "---:|---:|",
    ]
    for i, name in enumerate(names):
        worst = max(base[f"psnr_t{t}"] - trained[i][f"psnr_t{t}"] for t in steps)
        lines.append(
            f"| {name} | {trained[i]['eps_rel_change']:.4f} | {trained_rank[i]} | {trained[i]['psnr_drop']:+.3f} "
            f"| {worst:+.3f} |"
            + (f" {trained[i]['flicker']:.4f} |" if flicker else "")
            + f" {random[i]['eps_rel_change']:.4f} | {random_rank[i]} |"
        )
    return "\n".join(lines)


#: Bench column: relative change of the trained UNet denoiser's noise prediction, in percent.
TRAINED_EPS_CHANGE = "trained eps change %"
#: Bench column: drop of the UNet's x0 PSNR on held-out crops, in dB (positive = worse than unmerged).
TRAINED_PSNR_DROP = "trained PSNR drop dB"
#: The same two columns measured on the trained DiT, for PixArt's and SD3's rows.
DIT_EPS_CHANGE = "trained DiT eps change %"
DIT_PSNR_DROP = "trained DiT PSNR drop dB"
#: The same two measured on the trained FLUX-shaped model, for the joint rotary families' rows.
FLUX_EPS_CHANGE = "trained FLUX-shaped eps change %"
FLUX_PSNR_DROP = "trained FLUX-shaped PSNR drop dB"
#: The same two measured on the trained video model, for the video transformers' rows; also its flicker.
VIDEO_EPS_CHANGE = "trained video eps change %"
VIDEO_PSNR_DROP = "trained video PSNR drop dB"
VIDEO_FLICKER = "trained video flicker %"
#: Denoiser name -> the bench's (eps change, PSNR drop) columns measured on it.
TRAINED_COLUMNS: dict[str, tuple[str, str]] = {
    "unet": (TRAINED_EPS_CHANGE, TRAINED_PSNR_DROP),
    "dit": (DIT_EPS_CHANGE, DIT_PSNR_DROP),
    "flux": (FLUX_EPS_CHANGE, FLUX_PSNR_DROP),
    "video": (VIDEO_EPS_CHANGE, VIDEO_PSNR_DROP),
}
#: The families each shipped transformer measures; the rest (UNets, Stable Video Diffusion) the UNet does.
_TRANSFORMER_DENOISERS = {"dit": ("pixart", "sd3"), "flux": ("flux", "flux2", "chroma", "qwenimage", "zimage")}


def bench_denoiser(family: Family | str | None) -> str:
    """The shipped denoiser that measures a model family (a `Family` or its name): the model of its shape.

    `"dit"` (PixArt-shaped) for PixArt and SD3, `"flux"` (joint attention with rotary positions) for FLUX.1,
    FLUX.2, Chroma, Qwen-Image and Z-Image, `"video"` (Wan-shaped) for the video transformers, else `"unet"`
    (also for Stable Video Diffusion, whose spatial blocks merge each frame as a UNet's blocks merge an image).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> bench_denoiser(FAMILIES["flux"]()), bench_denoiser("sd3"), bench_denoiser("wan"), bench_denoiser(None)
        ('flux', 'dit', 'video', 'unet')
    """
    name = family if family is None or isinstance(family, str) else family.name
    for denoiser, names in _TRANSFORMER_DENOISERS.items():
        if name in names:
            return denoiser
    if name is not None and name != "svd" and name in FAMILIES and FAMILIES[name].video:
        return "video"
    return "unet"


def run_where_it_merges(
    model: torch.nn.Module,
    apply: Callable[[torch.nn.Module], object],
    remove: Callable[[torch.nn.Module], object] | None,
    run: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """`run()` with a method applied to `model`, merging wherever it selects, then removed (even if `run` fails).

    The quality of a method is measured where it merges: the pays rule (pays.py) only ever merges less, and on
    the small trained models it would merge nothing.
    """
    with pays_table(ALWAYS):
        apply(model)
        try:
            return run()
        finally:
            if remove is not None:
                remove(model)


def trained_quality_metrics(denoiser: str = "unet", **probe_options: Any) -> Callable[[Method], dict[str, float]]:
    """A bench `extra_metrics` callable that measures each method on a shipped trained denoiser.

    Random-weight models have no natural token redundancy, so their output error can rank methods
    differently from a trained model. The probe (`QualityProbe.default(denoiser=denoiser, **probe_options)`:
    the denoiser, held-out crops, fixed noise) is loaded once; each call applies the method to the
    denoiser, measures how much it changes the noise prediction and lowers the x0 PSNR, and removes it
    again. The columns are `TRAINED_COLUMNS[denoiser]`, and `VIDEO_FLICKER` on the video model. A method's
    `apply` must accept that model: the bench's transformer rows are `apply_tome` with a `ToMeConfig`, and
    each trained transformer takes its families' options (SD3 rows are merge-only, which PixArt takes too).

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
        row = {eps_column: 100.0 * measured["eps_rel_change"], psnr_column: measured["psnr_drop"]}
        if "flicker" in measured:
            row[VIDEO_FLICKER] = 100.0 * measured["flicker"]
        return row

    return metrics


@functools.lru_cache(maxsize=4)
def _shared_probe(
    denoiser: str, timesteps: tuple[int, ...], per_image: int, size: int | None, seed: int
) -> QualityProbe:
    # One probe per setting: the model loads and its unmerged prediction is computed once per process.
    return QualityProbe.default(timesteps, per_image=per_image, size=size, seed=seed, denoiser=denoiser)


def probe_quality(
    method: ToMeConfig | Mapping[str, Any] | Method | None = None,
    denoiser: str = "dit",
    *,
    timesteps: Sequence[int] = DEFAULT_TIMESTEPS,
    per_image: int = 2,
    size: int | None = None,
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
