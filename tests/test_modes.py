"""Modes beyond tomesd: K/V downsampling, merge reuse, per-level ratios, timestep schedules."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

import tome_processors.context as context_module
from tome_processors import ToMeConfig, apply_tome, remove_tome

from models import run_unet, tiny_unet, unet_inputs
from pipelines import tiny_sd_pipeline


@pytest.fixture
def unet():
    return tiny_unet("sd15")


class KeyValueRecorder(AttnProcessor2_0):
    def __init__(self):
        self.calls: list[tuple[int, int | None]] = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
        kv = None if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        self.calls.append((hidden_states.shape[1], kv))
        return super().__call__(attn, hidden_states, encoder_hidden_states, *args, **kwargs)


@pytest.mark.parametrize("pool", ["avg", "nearest"])
def test_downsample_kv_keeps_queries_and_pools_keys(unet, pool):
    inputs = unet_inputs(unet, 2, 16, 12)
    baseline = run_unet(unet, *inputs)
    recorder = KeyValueRecorder()
    unet.set_attn_processor(recorder)
    apply_tome(unet, mode="downsample_kv", kv_pool=pool)
    out = run_unet(unet, *inputs)
    assert torch.isfinite(out).all() and not torch.allclose(out, baseline, atol=1e-4)
    # Level 1 self-attention: all 192 queries, 48 pooled keys; other levels untouched.
    assert (192, 48) in recorder.calls
    assert (48, None) in recorder.calls  # level 2 self-attention keeps its own keys
    assert all(q != 192 or kv is not None for q, kv in recorder.calls)
    remove_tome(unet)
    assert torch.equal(run_unet(unet, *inputs), baseline)


def test_downsample_kv_factor_and_pool_change_the_output(unet):
    inputs = unet_inputs(unet, 2, 16, 16)
    outs = []
    for options in (dict(), dict(kv_pool="nearest"), dict(kv_factor=4)):
        apply_tome(unet, mode="downsample_kv", **options)
        outs.append(run_unet(unet, *inputs))
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def count_matchings(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = context_module.match

    def counting(metric, *args, **kwargs):
        calls.append(metric.shape[1])
        return original(metric, *args, **kwargs)

    monkeypatch.setattr(context_module, "match", counting)
    return calls


def test_share_level_computes_one_merge_per_level_and_forward(unet, monkeypatch):
    calls = count_matchings(monkeypatch)
    inputs = unet_inputs(unet)
    apply_tome(unet, ratio=0.5)
    per_block = run_unet(unet, *inputs)
    assert calls.count(256) == 3  # three blocks at the full level
    calls.clear()
    apply_tome(unet, ratio=0.5, share_level=True)
    shared = run_unet(unet, *inputs)
    run_unet(unet, *inputs)
    assert calls.count(256) == 2  # once per forward
    assert torch.isfinite(shared).all() and not torch.equal(shared, per_block)


def test_recompute_every_reuses_merges_across_steps(tmp_path, monkeypatch):
    # Through a pipeline, as users run it: every denoising step is one forward of the UNet (classifier-free
    # guidance batched), and the next call starts a new generation by itself (nothing resets in its place).
    pipe = tiny_sd_pipeline(tmp_path)
    apply_tome(pipe.unet, ratio=0.5, recompute_every=2)
    calls = count_matchings(monkeypatch)
    args = dict(prompt="a cat", height=32, width=32, output_type="np")  # a 16x16 latent: 256 tokens
    with torch.no_grad():
        pipe(**args, num_inference_steps=5)
        assert calls.count(256) == 3 * 3  # steps 0, 2 and 4 compute, 3 blocks each
        pipe(**args, num_inference_steps=2)
    assert calls.count(256) == 3 * 4  # the new generation's step 0 computes, its step 1 reuses


def test_recompute_every_counts_two_calls_with_one_timestep_as_one_step(unet, monkeypatch):
    # Unbatched classifier-free guidance: the pipeline calls the model twice per step with the same
    # timestep tensor. Both calls are one step, so recompute_every=2 computes on every other step.
    calls = count_matchings(monkeypatch)
    sample, _, text, _ = unet_inputs(unet)
    apply_tome(unet, ratio=0.5, recompute_every=2)
    for t in (999, 800, 600):
        timestep = torch.tensor(t)
        run_unet(unet, sample, timestep, text)  # conditional
        run_unet(unet, sample, timestep, text)  # unconditional
    assert calls.count(256) == 3 * 2  # steps 0 and 2 compute, 3 blocks each


def test_level_ratios(unet):
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    apply_tome(unet, ratio=0.5, max_downsample=1, use_rand=False)
    level_one = run_unet(unet, *inputs)
    apply_tome(unet, level_ratios={1: 0.5}, use_rand=False)
    assert torch.equal(run_unet(unet, *inputs), level_one)
    apply_tome(unet, level_ratios={2: 0.5}, use_rand=False)
    level_two = run_unet(unet, *inputs)
    assert not torch.equal(level_two, baseline) and not torch.equal(level_two, level_one)


def test_ratio_schedule_over_timesteps(unet):
    sample, _, text, _ = unet_inputs(unet)
    expected = {}
    for t in (1000, 0):
        remove_tome(unet)
        baseline = run_unet(unet, sample, torch.tensor(t), text)
        apply_tome(unet, ratio=0.5)
        expected[t] = (baseline, run_unet(unet, sample, torch.tensor(t), text))
    apply_tome(unet, ratio=0.5, ratio_start=0.0)
    assert torch.equal(run_unet(unet, sample, torch.tensor(1000), text), expected[1000][0])  # nothing merged
    assert torch.equal(run_unet(unet, sample, torch.tensor(0), text), expected[0][1])  # full ratio


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(mode="todo"), "Expected mode"),
        (dict(kv_factor=0), "Expected kv_factor"),
        (dict(kv_pool="max"), "Expected kv_pool"),
        (dict(recompute_every=0), "Expected recompute_every"),
        (dict(level_ratios={3: 0.5}), "Expected level_ratios keys"),
        (dict(level_ratios={1: 0.9}), "Expected level_ratios values"),
        (dict(level_ratios=[0.5]), "Expected level_ratios to be a mapping"),
        (dict(ratio_start=1.0), "Expected ratio_start"),
        (dict(share_level=1), "Expected share_level to be a bool"),
    ],
)
def test_mode_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        ToMeConfig(**options)


def test_level_ratios_config_is_hashable_and_replaceable():
    config = ToMeConfig(level_ratios={2: 0.3, 1: 0.6})
    assert config.level_ratios == ((1, 0.6), (2, 0.3))
    assert hash(config) == hash(config.replace())
    assert config.level_ratio(1, 1) == 0.6 and config.level_ratio(4, 8) == 0.0


def test_bfloat16_similarity_stays_close_to_exact(unet):
    inputs = unet_inputs(unet, 2, 16, 16)
    baseline = run_unet(unet, *inputs)
    apply_tome(unet, ratio=0.5)
    exact = run_unet(unet, *inputs)
    apply_tome(unet, ratio=0.5, similarity_dtype="bfloat16")
    fast = run_unet(unet, *inputs)
    change = (exact - baseline).norm()
    assert torch.isfinite(fast).all()
    # Different near-tie choices only: far smaller than what merging itself changes.
    assert (fast - exact).norm() < 0.5 * change
    with pytest.raises(ValueError, match="Expected similarity_dtype"):
        ToMeConfig(similarity_dtype="int8")
