"""ToMe while training: a LoRA on the attention projections (peft, `unet.add_adapter`) stepped with merging on.

Tiny SD1.5-shaped UNets (tests/models.py), a 16x16 latent: every check takes milliseconds per step.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from safetensors.torch import load_file

from tome_processors import apply_tome, remove_tome
from tome_processors.bench.profiling import is_attention_op
from tome_processors.bench.training import TrainingStep, add_lora, gradient_change
from tome_processors.bench.unet import UNetInputs
from tome_processors.cli.main import main
from tome_processors.config import PRESETS

from models import tiny_unet, unet_inputs

#: Per preset, the option that makes it do nothing: no tokens merged, or K/V "pooled" over 1x1 windows.
DO_NOTHING = {"exact": {"ratio": 0.0}, "balanced": {"kv_factor": 1}, "fast": {"kv_factor": 1, "level_kv_factors": None}}


def lora_unet(seed: int = 0) -> torch.nn.Module:
    """A tiny UNet with SDPA processors and a LoRA whose up-projections are random too (all get gradients)."""
    unet = tiny_unet("sd15", seed=seed)
    unet.set_attn_processor(AttnProcessor2_0())
    add_lora(unet, rank=4, seed=seed, init=False)
    return unet


def batch(unet: torch.nn.Module, height: int = 16, width: int = 16, seed: int = 0) -> UNetInputs:
    sample, _, text, _ = unet_inputs(unet, 2, height, width, seed=seed)
    return UNetInputs(sample=sample, timestep=torch.tensor(500), encoder_hidden_states=text)


def lora_state(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in unet.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("preset", PRESETS)
def test_gradients_reach_every_lora_weight(preset, one_thread):
    unet = lora_unet()
    step = TrainingStep(unet, batch(unet), seed=3)
    plain = step.gradients(unet)
    apply_tome(unet, preset=preset)
    merged = step.gradients(unet)
    assert merged.keys() == plain.keys() and len(merged) == 4 * 2 * 2 * 7  # projections x (A, B) x attns x blocks
    for name, grad in merged.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert gradient_change(merged, plain) > 1e-4  # the merging acts in the backward pass too
    before = lora_state(unet)
    step(unet)  # one AdamW step with ToMe on moves every LoRA weight
    after = lora_state(unet)
    assert all(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_step_that_merges_nothing_equals_the_plain_step(preset, one_thread):
    results = []
    for tome in (False, True):
        unet = lora_unet()
        if tome:
            with warnings.catch_warnings():  # "merges nothing" (ratio 0): the point here
                warnings.simplefilter("ignore")
                apply_tome(unet, preset=preset, **DO_NOTHING[preset])
        step = TrainingStep(unet, batch(unet), seed=5)
        losses = [step(unet), step(unet)]  # two AdamW steps, other timesteps each
        results.append((losses, lora_state(unet)))
    (plain_losses, plain_state), (tome_losses, tome_state) = results
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, tome_losses, strict=True))
    assert all(torch.equal(plain_state[name], tome_state[name]) for name in plain_state)  # bit for bit


@pytest.mark.parametrize("preset", PRESETS)
def test_gradient_checkpointing_gives_the_same_gradients(preset, one_thread):
    unet = lora_unet()
    apply_tome(unet, preset=preset)
    step = TrainingStep(unet, batch(unet), seed=7, gradient_checkpointing=False)
    plain = step.gradients(unet)
    step.gradient_checkpointing = True
    checkpointed = step.gradients(unet)
    assert unet.is_gradient_checkpointing
    for name, grad in plain.items():  # the recomputation merges the same tokens
        assert torch.equal(grad, checkpointed[name]), name


@pytest.mark.parametrize("preset", PRESETS)
def test_no_state_leaks_between_steps_of_other_timesteps_and_sizes(preset, one_thread):
    unet = lora_unet()
    apply_tome(unet, preset=preset)
    square = TrainingStep(unet, batch(unet, 16, 16), seed=0)
    wide = TrainingStep(unet, batch(unet, 16, 24, seed=1), seed=0)
    first = square.gradients(unet, seed=11)
    for seed in (12, 13):  # other sizes and timesteps in between
        wide.gradients(unet, seed=seed)
        square.gradients(unet, seed=seed)
    wide(unet)  # and an optimizer step of the other size
    again = square.gradients(unet, seed=11)
    assert gradient_change(again, first) > 0  # the step moved the weights: the same draw, other gradients
    fresh = lora_unet()
    fresh.load_state_dict(unet.state_dict())
    apply_tome(fresh, preset=preset)
    expected = TrainingStep(fresh, batch(fresh, 16, 16), seed=0).gradients(fresh, seed=11)
    for name, grad in expected.items():  # the same as a model that never saw the other steps
        assert torch.equal(again[name], grad), name


def test_tome_before_or_after_add_adapter_gives_the_same_step(one_thread):
    grads = []
    for before in (True, False):
        unet = tiny_unet("sd15", seed=0)
        unet.set_attn_processor(AttnProcessor2_0())
        if before:
            apply_tome(unet, preset="balanced")
        add_lora(unet, seed=0, init=False)
        if not before:
            apply_tome(unet, preset="balanced")
        grads.append(TrainingStep(unet, batch(unet), seed=2).gradients(unet))
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])


def test_saved_lora_never_mentions_tome(tmp_path, one_thread):
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    unet = lora_unet()
    plain = get_peft_model_state_dict(unet)
    apply_tome(unet, preset="balanced")
    TrainingStep(unet, batch(unet), seed=0)(unet)  # trained with ToMe on
    merged = get_peft_model_state_dict(unet)
    assert merged.keys() == plain.keys()
    assert not any("tome" in key.lower() for key in merged)
    layers = convert_state_dict_to_diffusers(merged)
    StableDiffusionPipeline.save_lora_weights(tmp_path / "on", unet_lora_layers=layers)
    remove_tome(unet)
    StableDiffusionPipeline.save_lora_weights(
        tmp_path / "off", unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    )
    on = load_file(tmp_path / "on" / "pytorch_lora_weights.safetensors")
    off = load_file(tmp_path / "off" / "pytorch_lora_weights.safetensors")
    assert on.keys() == off.keys() and all(torch.equal(on[key], off[key]) for key in on)
    # and it loads into a model that never had ToMe
    fresh = tiny_unet("sd15", seed=0)
    fresh.load_lora_adapter(on, prefix="unet")
    assert len(fresh.peft_config) == 1


def test_training_step_keeps_mixed_precision_weights_in_float32(one_thread):
    unet = tiny_unet("sd15").to(dtype=torch.bfloat16)
    inputs = batch(unet)
    inputs = UNetInputs(inputs.sample.bfloat16(), inputs.timestep, inputs.encoder_hidden_states.bfloat16())
    step = TrainingStep(unet, inputs, seed=0)
    assert step.params and all(p.dtype == torch.float32 for p in step.params)
    assert torch.isfinite(step(unet))  # under autocast on the CPU


def test_bench_train_quick_writes_its_json(tmp_path):
    path = tmp_path / "train.json"
    argv = ["bench", "--train", "--quick", "--threads", "1", "--rounds", "1", "--no-progress", "--no-trained-quality"]
    argv += ["--no-host-cost", "--no-tomesd", "--presets", "balanced", "--gradient-checkpointing", "--json", str(path)]
    assert main([*argv, "--profile", str(tmp_path / "steps.md")]) == 0
    data = json.loads(path.read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows) == ["baseline", "ours balanced", "baseline (checkpointing)", "ours balanced (checkpointing)"]
    for row in rows.values():
        assert row["seconds"] > 0 and row["speedup"] > 0 and row["peak_memory_mib"] > 0
        assert row["settings"]["gradient_checkpointing"] == row["name"].endswith("(checkpointing)")
    assert rows["baseline"]["rel_error"] == 0.0 and rows["ours balanced"]["rel_error"] > 0
    # checkpointing recomputes the same merges: the same gradient change, both measured on the same weights
    assert rows["ours balanced"]["rel_error"] == pytest.approx(rows["ours balanced (checkpointing)"]["rel_error"])
    assert data["meta"]["gradient_checkpointing"] == "both" and "AdamW" in data["meta"]["step"]
    # --profile times one whole step per row: attention's backward kernels and the optimizer are in it
    text = (tmp_path / "steps.md").read_text()
    assert all(f"### {name}: " in text for name in rows)
    baseline = rows["baseline"]["profile"]
    names = {op["name"] for op in baseline["ops"]}
    assert any(is_attention_op(name) and "backward" in name for name in names)
    assert any("AdamW" in name for name in names)
    assert 0 < baseline["attention_ms"] < baseline["total_ms"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--train", "--pipeline"],
        ["--train", "--arch", "pixart"],
        ["--train", "--compile"],
        ["--gradient-checkpointing", "on"],
        ["--train", "--arch", "svd"],
        ["--train", "--plot", "p.png"],
    ],
)
def test_bench_train_rejects_what_it_cannot_run(extra, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *extra] if "--arch" in extra else ["bench", "--quick", *extra])
    assert exit_info.value.code == 2
    assert "Expected" in capsys.readouterr().err


def test_training_table_names_its_columns():
    from tome_processors.bench.engine import Row
    from tome_processors.bench.report import markdown_table

    header = markdown_table([Row("baseline", "baseline", None, 1.5, 1.0, 0.0)], unit="step", error="grad %")
    assert header.startswith("| method | ratio | s/step | baseline s/step | speed-up | speed-up min-max |")
    assert "| grad % |" in header.splitlines()[0]
