"""`bench.sampling.SamplingProbe`: whole trajectories on the shipped trained denoisers."""

from __future__ import annotations

import pytest
import torch

from tome_processors import apply_tome, remove_tome
from tome_processors.bench.sampling import SamplingProbe

pytest.importorskip("skimage")


@pytest.fixture(scope="module")
def probe() -> SamplingProbe:
    torch.set_num_threads(1)
    return SamplingProbe.default("unet", steps=10, strength=0.5)


def test_runs_the_last_strength_share_of_the_schedule(probe):
    assert probe.timesteps == sorted(probe.timesteps, reverse=True) and len(probe.timesteps) == 5
    assert probe.timesteps[-1] == 0 and probe.timesteps[0] < 1000


def test_the_unmerged_run_is_the_reference_and_denoises(probe):
    row = probe.measure()
    assert row["image_change"] == 0.0 and row["psnr_drop"] == 0.0
    noisy = float(((probe.start.clamp(-1, 1) - probe.crops) ** 2).mean())
    assert float(((probe.baseline() - probe.crops) ** 2).mean()) < noisy  # closer to the clean crops


def test_reuse_across_steps_changes_the_trajectory_and_is_removed(probe):
    every_step = probe.measure(lambda m: apply_tome(m), remove_tome)
    reused = probe.measure(lambda m: apply_tome(m, recompute_every=3), remove_tome)
    assert 0 < every_step["image_change"] < 0.5 and reused["image_change"] != every_step["image_change"]
    assert torch.equal(probe.sample(), probe.baseline())  # removed after each run


@pytest.mark.parametrize(("options", "match"), [({"strength": 0.0}, "strength"), ({"steps": 0}, "steps")])
def test_bad_options_raise(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingProbe(torch.nn.Identity(), {}, torch.zeros(1, 3, 8, 8), **options)
