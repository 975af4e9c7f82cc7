"""UNets and fixed inputs for `tome-processors bench`: real UNet architectures with random weights, or a user's.

Nothing is downloaded unless `--model` names a hub id. The architectures follow the published configs of
Stable Diffusion 1.5, 2.x and XL (channels, heads, cross-attention width, transformer depth); their weights
are diffusers' random initialisation, so speed and memory are those of the real model, while the output
change measures how far merging moves an untrained network, not image quality.

Example:
    >>> unet = build_unet("tiny")
    >>> inputs = make_inputs(unet, batch=2, resolution=64)
    >>> tuple(inputs.sample.shape)
    (2, 4, 8, 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import UNet2DConditionModel

__all__ = [
    "ARCHITECTURES",
    "UNetInputs",
    "UNetProxy",
    "build_unet",
    "default_proxy",
    "load_unet",
    "make_inputs",
    "proxy_config",
]

_SD15: dict[str, Any] = dict(
    sample_size=64,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=2,
    cross_attention_dim=768,
    attention_head_dim=8,
)
_SD2: dict[str, Any] = dict(
    _SD15,
    sample_size=96,
    cross_attention_dim=1024,
    attention_head_dim=(5, 10, 20, 20),
    use_linear_projection=True,
)
_SDXL: dict[str, Any] = dict(
    sample_size=128,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=2,
    transformer_layers_per_block=(1, 2, 10),
    cross_attention_dim=2048,
    attention_head_dim=(5, 10, 20),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
# Same block layout as SD1.5 (attention at the first two levels), tiny widths: a forward takes milliseconds.
_TINY: dict[str, Any] = dict(
    sample_size=32,
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1,
    norm_num_groups=8,
    cross_attention_dim=32,
    attention_head_dim=8,
)
_TINY_XL: dict[str, Any] = dict(
    _TINY,
    block_out_channels=(32, 64, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4, 8),
    use_linear_projection=True,
    transformer_layers_per_block=(1, 1, 2),
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=32 + 6 * 8,
)

#: Architecture name -> `UNet2DConditionModel` config. "tiny" / "tiny-sdxl" are for `--quick`.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "sd15": _SD15,
    "sd2": _SD2,
    "sdxl": _SDXL,
    "tiny": _TINY,
    "tiny-sdxl": _TINY_XL,
}

#: Text tokens of the cross-attention context (CLIP's 77).
TEXT_TOKENS = 77


@dataclass(frozen=True)
class UNetProxy:
    """A UNet cut down to what merging acts on, for high resolutions where a whole forward is too long.

    The UNet keeps its first `levels` levels (the down block and the matching up block of each, no mid
    block) at their real channels, heads and cross-attention width, so every kept level sees the real
    token count at a given resolution; `layers` caps the ResNet and transformer layers per down block (the
    up blocks keep one more, as in every diffusers UNet) and the transformer layers per attention block
    (SDXL's 2 and 10). The levels left out (and the mid block) are not run: a speed-up measured on the
    proxy is that of the kept levels, above the whole forward's.

    Example:
        >>> UNetProxy(levels=2, layers=1).describe("sd15", 1024)
        "the UNet's first 2 of 4 levels (320, 640 channels; 16384, 4096 tokens), 1 layer per block, no mid block"
    """

    levels: int
    layers: int | None = None

    def __post_init__(self) -> None:
        if self.levels < 1:
            raise ValueError(f"Expected levels >= 1, but got {self.levels}.")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"Expected layers >= 1 (or None), but got {self.layers}.")

    def describe(self, arch: str, height: int | None = None, width: int | None = None) -> str:
        """One line for the report: which levels are kept, at which width and token count (given the image's
        `height` and `width` in pixels), with how many layers."""
        config = ARCHITECTURES[arch]
        total = len(config["block_out_channels"])
        channels = config["block_out_channels"][: self.levels]
        kept = ", ".join(str(c) for c in channels) + " channels"
        if height is not None:
            width = height if width is None else width
            tokens = [(height // 8 >> level) * (width // 8 >> level) for level in range(len(channels))]
            kept += "; " + ", ".join(str(t) for t in tokens) + " tokens"
        layers = "the real layers" if self.layers is None else f"{self.layers} layer{'s' * (self.layers > 1)}"
        return (
            f"the UNet's first {min(self.levels, total)} of {total} levels ({kept}), {layers} per block, no mid block"
        )


def _per_level(value: Any, levels: int, cap: int | None) -> Any:
    """A per-level config value (an int or one per level) for the first `levels` levels, capped at `cap`."""
    if isinstance(value, (list, tuple)):
        return tuple(min(v, cap) if cap is not None else v for v in value[:levels])
    return min(value, cap) if cap is not None else value


def proxy_config(arch: str, proxy: UNetProxy) -> dict[str, Any]:
    """The `UNet2DConditionModel` config of `arch` cut down to `proxy`'s levels and layers.

    Example:
        >>> config = proxy_config("sdxl", UNetProxy(levels=2, layers=1))
        >>> config["block_out_channels"], config["up_block_types"], config["transformer_layers_per_block"]
        ((320, 640), ('CrossAttnUpBlock2D', 'UpBlock2D'), (1, 1))
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"Expected arch among {sorted(ARCHITECTURES)}, but got {arch!r}.")
    config = dict(ARCHITECTURES[arch])
    total = len(config["block_out_channels"])
    if proxy.levels > total:
        raise ValueError(f"Expected at most {total} levels for {arch}, but got levels={proxy.levels}.")
    n = proxy.levels
    config.update(
        block_out_channels=tuple(config["block_out_channels"][:n]),
        down_block_types=tuple(config["down_block_types"][:n]),
        up_block_types=tuple(config["up_block_types"][total - n :]),
        layers_per_block=_per_level(config.get("layers_per_block", 2), n, proxy.layers),
        mid_block_type=None,
    )
    for key in ("transformer_layers_per_block", "attention_head_dim"):
        if key in config:
            cap = proxy.layers if key == "transformer_layers_per_block" else None
            config[key] = _per_level(config[key], n, cap)
    return config


def default_proxy(arch: str) -> UNetProxy:
    """The proxy the bench uses where a whole forward would take too long: every level up to the second one
    with attention (the levels the presets act on), one layer per block.

    Example:
        >>> default_proxy("sd15"), default_proxy("sdxl")
        (UNetProxy(levels=2, layers=1), UNetProxy(levels=3, layers=1))
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"Expected arch among {sorted(ARCHITECTURES)}, but got {arch!r}.")
    kinds = ARCHITECTURES[arch]["down_block_types"]
    with_attention = [i for i, kind in enumerate(kinds) if kind.startswith("CrossAttn")]
    return UNetProxy(levels=with_attention[min(1, len(with_attention) - 1)] + 1, layers=1)


def build_unet(arch: str, seed: int = 0, proxy: UNetProxy | None = None) -> UNet2DConditionModel:
    """A UNet of the named architecture with random weights (seeded), in eval mode; cut down to `proxy`.

    Example:
        >>> tuple(build_unet("tiny").config.block_out_channels)
        (32, 64)
        >>> build_unet("tiny", proxy=UNetProxy(levels=1)).mid_block is None
        True
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"Expected arch among {sorted(ARCHITECTURES)}, but got {arch!r}.")
    torch.manual_seed(seed)
    config = ARCHITECTURES[arch] if proxy is None else proxy_config(arch, proxy)
    return UNet2DConditionModel(**config).eval()


def load_unet(model: str, dtype: torch.dtype | None = None) -> UNet2DConditionModel:
    """A UNet from a local folder or hub id: a pipeline (with a `unet/` subfolder) or a UNet folder itself.

    Example:
        >>> unet = load_unet("stable-diffusion-v1-5/stable-diffusion-v1-5")  # doctest: +SKIP
    """
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    folder = Path(model)
    if folder.is_dir():
        if (folder / "unet").is_dir():
            return UNet2DConditionModel.from_pretrained(folder, subfolder="unet", **kwargs).eval()
        return UNet2DConditionModel.from_pretrained(folder, **kwargs).eval()
    try:  # a hub id: most are pipelines
        return UNet2DConditionModel.from_pretrained(model, subfolder="unet", **kwargs).eval()
    except (OSError, ValueError):
        return UNet2DConditionModel.from_pretrained(model, **kwargs).eval()


@dataclass
class UNetInputs:
    """Fixed inputs of one UNet forward, the same for every method.

    Attributes:
        sample: `(B, in_channels, H/8, W/8)` latent.
        timestep: a scalar tensor (500, the middle of the schedule).
        encoder_hidden_states: `(B, 77, cross_attention_dim)` text context.
        added_cond_kwargs: SDXL's `text_embeds` and `time_ids`, or None.
    """

    sample: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    added_cond_kwargs: dict[str, torch.Tensor] | None = None

    def run(self, unet: torch.nn.Module) -> torch.Tensor:
        """One forward (positional `sample`, as tomesd's hook needs); returns the output sample."""
        with torch.inference_mode():
            return unet(
                self.sample,
                self.timestep,
                encoder_hidden_states=self.encoder_hidden_states,
                added_cond_kwargs=self.added_cond_kwargs,
            ).sample


def _cross_dim(config: Any) -> int:
    dim = config.cross_attention_dim
    return int(dim[0] if isinstance(dim, (list, tuple)) else dim)


def make_inputs(
    unet: UNet2DConditionModel,
    batch: int,
    resolution: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    width: int | None = None,
) -> UNetInputs:
    """Random fixed inputs for `unet` at `resolution` pixels high and `width` wide (None: square); the latent is
    `(resolution // 8, width // 8)`.

    Example:
        >>> make_inputs(build_unet("tiny-sdxl"), batch=1, resolution=64).added_cond_kwargs["time_ids"].shape
        torch.Size([1, 6])
        >>> tuple(make_inputs(build_unet("tiny"), batch=1, resolution=64, width=96).sample.shape)
        (1, 4, 8, 12)
    """
    config = unet.config
    width = resolution if width is None else width
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, config.in_channels, resolution // 8, width // 8, generator=g)
    text = torch.randn(batch, TEXT_TOKENS, _cross_dim(config), generator=g)
    added = None
    if config.addition_embed_type == "text_time":
        time_dims = 6 * int(config.addition_time_embed_dim)
        text_embeds = torch.randn(batch, int(config.projection_class_embeddings_input_dim) - time_dims, generator=g)
        # original size, crop offset, `target_size`: what SDXL pipelines pass.
        time_ids = torch.tensor([resolution, width, 0, 0, resolution, width], dtype=torch.float32)
        added = {
            "text_embeds": text_embeds.to(device, dtype),
            "time_ids": time_ids.repeat(batch, 1).to(device, dtype),
        }
    return UNetInputs(
        sample=sample.to(device, dtype),
        timestep=torch.tensor(500, device=device),
        encoder_hidden_states=text.to(device, dtype),
        added_cond_kwargs=added,
    )
