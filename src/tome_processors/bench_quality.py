"""The trained-model columns of `tome-processors bench`: each method measured on the shipped denoiser.

Random-weight UNets have no natural token redundancy, so their output error can rank methods
differently from a trained model. Next to that error, the bench runs every method on the small
denoiser trained on photos (`tome_processors.quality`) and reports how much it changes the noise
prediction and how much it lowers the PSNR of the clean-image estimate on held-out crops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .benchmark import Method

__all__ = ["TRAINED_EPS_CHANGE", "TRAINED_PSNR_DROP", "trained_quality_metrics"]

#: Column: relative change of the trained denoiser's noise prediction, in percent.
TRAINED_EPS_CHANGE = "trained eps change %"
#: Column: drop of the x0 PSNR on held-out crops, in dB (positive = worse than unmerged).
TRAINED_PSNR_DROP = "trained PSNR drop dB"


def trained_quality_metrics(**probe_options: Any) -> Callable[[Method], dict[str, float]]:
    """A bench `extra_metrics` callable that measures each method on the shipped trained denoiser.

    The probe (the denoiser, held-out crops, fixed noise) is loaded once; each call applies the
    method to the denoiser, measures, and removes it again.

    Example:
        >>> from tome_processors.bench_methods import baseline_method
        >>> metrics = trained_quality_metrics(timesteps=(500,))
        >>> metrics(baseline_method())[TRAINED_EPS_CHANGE]
        0.0
    """
    from .quality import QualityProbe  # noqa: PLC0415

    probe = QualityProbe.default(**probe_options)

    def metrics(method: Method) -> dict[str, float]:
        measured = probe.measure(method.apply, method.remove)
        return {
            TRAINED_EPS_CHANGE: 100.0 * measured["eps_rel_change"],
            TRAINED_PSNR_DROP: measured["psnr_drop"],
        }

    return metrics
