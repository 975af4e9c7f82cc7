"""Whole sampling runs on the shipped trained denoisers: where reuse across denoising steps shows.

`QualityProbe` (quality.py) measures one forward at fixed noise levels, so it cannot see what
`recompute_every` (merges reused over steps) or a merge error carried from step to step does.
`SamplingProbe` runs whole DDIM trajectories instead: held-out crops are noised to `strength` and
denoised back in `steps` steps (image-to-image, so the result has a ground truth), once unmerged and
once with a method applied, and reports how much the final images change and how far they are from
the clean crops.

Example:
    >>> probe = SamplingProbe.default("unet", steps=10)
    >>> row = probe.measure(lambda m: apply_tome(m, recompute_every=2), remove_tome)  # doctest: +SKIP
    >>> row["image_change"], row["psnr_drop"]  # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from diffusers import DDIMScheduler
from diffusers.models.cache_utils import CacheMixin

from .engine import Apply, relative_error
from .quality import (
    context_dim,
    context_embedding,
    heldout_samples,
    load_denoiser,
    predict_noise,
    psnr,
    run_where_it_merges,
)


class SamplingProbe:
    """A trained denoiser, held-out crops, fixed noise and a DDIM schedule: measures whole trajectories.

    Args:
        model: a shipped denoiser (see `quality.load_denoiser`), predicting epsilon on [-1, 1] images.
        scheduler_config: the noise schedule it was trained with; sampling uses DDIM on it.
        crops: clean images [N, 3, H, W] (or clips [N, 3, F, H, W]) in [-1, 1].
        steps: DDIM steps over the whole schedule; a run takes the last `strength` share of them.
        strength: how far the crops are noised before denoising (0: not at all, 1: pure noise).
        seed: seeds the noise.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        scheduler_config: dict,
        crops: torch.Tensor,
        steps: int = 20,
        strength: float = 0.6,
        seed: int = 0,
    ) -> None:
        if not 0.0 < strength <= 1.0:
            raise ValueError(f"Expected strength in (0, 1], but got {strength}.")
        if steps < 1:
            raise ValueError(f"Expected steps >= 1, but got {steps}.")
        self.model = model.eval()
        self.crops = crops.float()
        self.scheduler = DDIMScheduler.from_config(scheduler_config)
        self.scheduler.set_timesteps(steps)
        first = steps - max(1, round(steps * strength))
        self.timesteps = [int(t) for t in self.scheduler.timesteps[first:]]
        noise = torch.randn(self.crops.shape, generator=torch.Generator().manual_seed(seed))
        self.start = self.scheduler.add_noise(self.crops, noise, torch.tensor([self.timesteps[0]]))
        self.context = context_embedding(crops.shape[0], context_dim(model))
        self.current_timestep: int | None = None  # during `sample`, as a pipeline's (caches read it)
        self._base: torch.Tensor | None = None

    @classmethod
    def default(
        cls, denoiser: str = "unet", steps: int = 20, strength: float = 0.6, per_image: int = 1, seed: int = 0
    ) -> SamplingProbe:
        """A shipped denoiser (a name of `quality.DENOISERS`) on its held-out samples (`quality.heldout_samples`).

        Example:
            >>> len(SamplingProbe.default("dit", steps=10, strength=0.5).timesteps)
            5
        """
        model, scheduler = load_denoiser(denoiser)
        return cls(model, scheduler.config, heldout_samples(denoiser, per_image, None, seed), steps, strength, seed)

    def sample(self) -> torch.Tensor:
        """The denoised crops after the whole trajectory: [N, 3, H, W].

        A model with diffusers' caches enabled is driven as a pipeline drives it: its cache state reset
        before the trajectory, each call inside a cache context, `current_timestep` set.
        """
        x = self.start.clone()
        if isinstance(self.model, CacheMixin) and self.model.is_cache_enabled:
            self.model._reset_stateful_cache()  # what a pipeline's end of call does (maybe_free_model_hooks)
        with torch.no_grad():
            for t in self.timesteps:
                self.current_timestep = t
                with self._step_context():
                    eps = predict_noise(self.model, x, t, self.context)[:, :3].float()
                x = self.scheduler.step(eps, t, x).prev_sample
        self.current_timestep = None
        return x.clamp(-1.0, 1.0)

    def _step_context(self) -> AbstractContextManager:
        return self.model.cache_context("cond") if isinstance(self.model, CacheMixin) else nullcontext()

    def baseline(self) -> torch.Tensor:
        """The unmerged model's result (computed once)."""
        if self._base is None:
            self._base = self.sample()
        return self._base

    def measure(self, apply: Apply | None = None, remove: Apply | None = None) -> dict[str, float]:
        """Run the trajectory with a method applied (and removed after, even on failure).

        Returns:
            `image_change` (`||x - x_base|| / ||x_base||` of the final images), `psnr` (final images
            against the clean crops, dB) and `psnr_drop` (the unmerged run's PSNR minus this).
        """
        base = self.baseline()
        result = base if apply is None else run_where_it_merges(self.model, apply, remove, self.sample)
        change = relative_error(result, base)
        value = psnr(result, self.crops)
        return {"image_change": change, "psnr": value, "psnr_drop": psnr(base, self.crops) - value}
