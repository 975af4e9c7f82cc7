"""`tome-processors bench --pipeline`: whole generations on random-weight pipelines (no timing assertions).

Every run here is `--quick` (tiny components), 2 steps, at 64 px: a few seconds each.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
)
from PIL import Image
from transformers import CLIPTokenizer, T5EncoderModel, T5Tokenizer

from tome_processors.bench.dit import build_transformer
from tome_processors.bench.engine import BenchSettings, Method, pair_with_baseline
from tome_processors.bench.generate import (
    DenoiserTimer,
    GenerationRow,
    generation_table,
    time_generations,
)
from tome_processors.bench.methods import baseline_method
from tome_processors.bench.models import build_model
from tome_processors.bench.pipelines import SMALL_TEXT_LAYERS, build_pipeline, write_clip_tokenizer, write_t5_tokenizer
from tome_processors.bench.unet import build_unet
from tome_processors.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--pipeline", "--quick", "--steps", "2", "--resolution", "64", "--rounds", "1", "--threads", "1"]
FAST += ["--no-progress"]
SECONDS = ("seconds_per_image", "speedup_per_image", "seconds_per_step", "speedup_per_step")


def run_cli(tmp_path, *argv: str) -> dict:
    path, grid = tmp_path / "p.json", tmp_path / "grid.png"
    assert main(["bench", *FAST, *argv, "--json", str(path), "--grid", str(grid)]) == 0
    with Image.open(grid) as image:
        assert image.format == "PNG"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def sd15_run(tmp_path_factory):
    """One default `bench --pipeline --quick` (baseline, the three presets, tomesd), shared below."""
    return run_cli(tmp_path_factory.mktemp("sd15"))


def test_default_rows_time_whole_generations(sd15_run):
    rows = {row["name"]: row for row in sd15_run["rows"]}
    assert list(rows)[0] == "baseline" and {"ours balanced", "ours fast", "tomesd r=0.5"} <= set(rows)
    assert any(name.startswith("ours exact") for name in rows)
    for row in rows.values():
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in SECONDS), row["name"]
        # PNDM: one UNet call per step plus one; a step is far shorter than the whole image
        assert row["denoiser_calls"] == 3 and row["seconds_per_step"] < row["seconds_per_image"]
        assert len(row["image_times"]) == len(row["step_times"]) >= 1
    assert rows["baseline"]["speedup_per_image"] == 1.0 and rows["baseline"]["speedup_per_step"] == 1.0
    assert rows["baseline"]["image_change"] == 0.0
    for name, row in rows.items():
        if name != "baseline":
            assert 0.0 < row["image_change"] < 1.0, name  # merging changes the final image, but not wildly


def test_meta_says_what_was_built(sd15_run):
    meta = sd15_run["meta"]
    assert meta["pipeline"] == "StableDiffusionPipeline" and meta["steps"] == 2
    assert meta["batch"] == 2 and sd15_run["rows"][0]["denoiser_batch"] == 2  # one image, guidance batched
    assert meta["denoiser_calls"] == 3 and meta["resolution"] == 64
    components = meta["components"]
    assert set(components) == {"unet", "text_encoder", "tokenizer", "vae", "scheduler"}
    assert "tiny" in components["text_encoder"] and components["scheduler"].startswith("PNDMScheduler")


@pytest.mark.parametrize("arch", ["pixart", "sd3", "flux"])
def test_transformer_pipelines(arch, tmp_path):
    data = run_cli(tmp_path, "--arch", arch, "--presets", "fast", "--no-memory")
    rows = data["rows"]
    assert [row["name"] for row in rows][0] == "baseline" and rows[1]["name"].startswith("ours fast")
    assert all(all(math.isfinite(row[key]) for key in SECONDS) for row in rows)
    assert rows[0]["image_change"] == 0.0 and rows[1]["image_change"] > 0.0
    assert rows[0]["denoiser_calls"] == 2 and rows[0]["peak_memory_mib"] is None
    assert data["meta"]["batch"] == (1 if arch == "flux" else 2)  # Flux's guidance is an input, not a batch


def test_ratios_and_modes_add_rows(tmp_path):
    data = run_cli(tmp_path, "--presets", "none", "--ratios", "0.5", "--modes", "kv-avg", "--no-tomesd")
    assert [row["name"] for row in data["rows"]] == ["baseline", "ours r=0.5", "ours kv-avg"]


def test_no_decode_times_generations_up_to_the_latents(tmp_path):
    # The pipeline stops at its latents: no image grid, the meta says so, and the rows still compare methods.
    path, grid = tmp_path / "n.json", tmp_path / "grid.png"
    argv = [*FAST, "--presets", "fast", "--no-tomesd", "--no-decode", "--json", str(path), "--grid", str(grid)]
    assert main(["bench", *argv]) == 0
    data = json.loads(path.read_text())
    assert not grid.exists() and data["meta"]["output"].startswith("latents (no VAE decode")
    rows = {row["name"]: row for row in data["rows"]}
    assert rows["baseline"]["image_change"] == 0 and rows[data["rows"][1]["name"]]["image_change"] > 0
    assert all(row["seconds_per_image"] > 0 for row in data["rows"])


def test_model_pipeline_of_a_transformer_runs_the_same_path(tmp_path):
    build_model(arch="pixart", quick=True, pipeline=True).pipe.save_pretrained(tmp_path / "pipe")
    path = tmp_path / "m.json"
    argv = ["bench", "--model", str(tmp_path / "pipe"), "--pipeline", "--steps", "2", "--resolution", "64"]
    argv += ["--rounds", "1", "--threads", "1", "--no-progress", "--presets", "fast", "--no-memory"]
    assert main([*argv, "--json", str(path), "--grid", str(tmp_path / "g.png")]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["pipeline"] == "PixArtAlphaPipeline" and "loaded" in data["meta"]["components"]["vae"]
    assert [row["image_change"] > 0 for row in data["rows"]] == [False, True]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pipeline", "--compile"], "without --compile"),
        (["--pipeline", "--steps", "0"], "--steps >= 1"),
        (["--pipeline", "--batch", "2"], "without --batch"),
        (["--pipeline", "--plot", "p.png"], "without --plot"),
        (["--text-encoders", "small"], "only with --pipeline"),
        (["--pipeline", "--quick", "--text-encoders", "small"], "not with --model or --quick"),
        (["--pipeline", "--arch", "sd3", "--resolution", "72"], "multiple of 16"),
        (["--no-decode"], "--no-decode only with --pipeline"),
    ],
)
def test_bad_pipeline_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_step_time_is_the_time_inside_the_denoiser():
    # A method that makes every denoiser forward 100 ms longer: its per-step time grows by about that much
    # and its per-step speed-up falls below 1, while the baseline pairs with itself. The sleep is long beside the
    # tiny forward (tens of ms) so that a loaded machine's noise cannot hide it.
    bench = build_model(arch="sd15", quick=True, pipeline=True)
    handles = []

    def slow(unet):
        handles.append(unet.register_forward_hook(lambda *args: time.sleep(0.1)))

    def fast(unet):
        handles.pop().remove()

    methods = [baseline_method(), Method("slow", "slow", None, slow, fast)]
    settings = BenchSettings(rounds=2, measure_memory=False, host_cost=False, progress=False)
    run = time_generations(bench.pipe, methods, "a cat", steps=2, resolution=64, settings=settings)
    base, slowed = run.rows
    assert slowed.seconds_per_step - base.seconds_per_step > 0.06 and slowed.speedup_per_step < 1.0
    assert slowed.image_change == 0.0 and not handles  # a hook that only waits changes nothing, and came off
    assert len(run.images) == 2 and run.images[0].size == (64, 64)


def test_pairing_takes_the_mean_of_the_baseline_runs_around_each_group():
    # Methods 1 and 2 in one group between two baseline runs (0.2 s and 0.4 s): paired with 0.3; the engine
    # pairs whole generations and their time per step with this one rule.
    paired = pair_with_baseline([(0, 0.2), (1, 0.1), (2, 0.2), (0, 0.4)], 3)
    assert paired == [([0.2, 0.4], [0.2, 0.4]), ([0.1], [pytest.approx(0.3)]), ([0.2], [pytest.approx(0.3)])]
    with pytest.raises(ValueError, match="end with the baseline"):
        pair_with_baseline([(0, 0.2), (1, 0.1)], 2)


def test_denoiser_timer_counts_forwards_and_lets_go():
    layer = torch.nn.Linear(2, 2)
    with DenoiserTimer(layer) as timer:
        for _ in range(3):
            layer(torch.ones(1, 2))
    assert timer.calls == 3 and timer.seconds > 0
    layer(torch.ones(1, 2))
    assert timer.calls == 3 and not layer._forward_hooks and not layer._forward_pre_hooks
    with DenoiserTimer(layer) as timer:
        layer(input=torch.ones(4, 2))  # neither positional nor a latent's name: no batch seen
    assert timer.batch is None and timer.calls == 1


def test_generation_table():
    rows = [GenerationRow("baseline", "baseline", None, 2.0, 1.0, 0.1, 1.0, 0.0, 21)]
    rows.append(GenerationRow("ours fast", "ours fast", 0.6, 1.5, 1.33, 0.07, 1.43, 0.021, 21, peak_memory_mib=900.4))
    header, _, _, line = generation_table(rows).splitlines()
    assert header.startswith("| method | ratio | s/image | speed-up/image | s/step | speed-up/step |")
    assert line == "| ours fast | 0.6 | 1.50 | 1.33x | 0.070 | 1.43x | 2.10 | 900 |"


def test_tokenizers_are_written_locally(tmp_path):
    clip = write_clip_tokenizer(tmp_path / "clip")
    assert (tmp_path / "clip" / "vocab.json").is_file() and isinstance(clip, CLIPTokenizer)
    padded = clip("a cat", padding="max_length", max_length=clip.model_max_length).input_ids
    assert len(padded) == 77 and padded[:2] == [0, 3]
    t5 = write_t5_tokenizer(tmp_path / "t5")
    assert any((tmp_path / "t5").iterdir()) and isinstance(t5, T5Tokenizer)
    ids = t5("a red fox", padding="max_length", max_length=120).input_ids
    assert len(ids) == 120 and ids[ids.index(1) + 1 :] == [0] * (119 - ids.index(1))  # </s>, then padding
    assert t5.decode(ids, skip_special_tokens=True) == "a red fox"


def test_quick_components_are_the_real_pipelines_classes():
    sd15 = build_pipeline(build_unet("tiny"), "sd15", quick=True).pipe
    assert isinstance(sd15, StableDiffusionPipeline) and isinstance(sd15.scheduler, PNDMScheduler)
    assert sd15.safety_checker is None
    sd3 = build_pipeline(build_transformer("sd3", quick=True), "sd3", quick=True)
    assert isinstance(sd3.pipe, StableDiffusion3Pipeline) and isinstance(sd3.pipe.text_encoder_3, T5EncoderModel)
    assert isinstance(sd3.pipe.scheduler, FlowMatchEulerDiscreteScheduler) and sd3.call_kwargs["max_sequence_length"]
    pixart = build_pipeline(build_transformer("pixart", quick=True), "pixart", quick=True).pipe
    assert isinstance(pixart.scheduler, DPMSolverMultistepScheduler) and isinstance(pixart.tokenizer, T5Tokenizer)
    with pytest.raises(ValueError, match="text_encoders among"):
        build_pipeline(build_unet("tiny"), "sd15", text_encoders="huge")


def _full(arch: str, text_encoders: str = "full"):
    """The full-size pipeline on the meta device: shapes only, no memory, no weights."""
    with torch.device("meta"):
        denoiser = build_unet(arch) if arch in ("sd15", "sd2", "sdxl") else build_transformer(arch)
        return build_pipeline(denoiser, arch, text_encoders=text_encoders)


@pytest.mark.parametrize("arch", ["sd15", "sd2", "sdxl", "pixart", "sd3", "flux"])
def test_full_size_components_fit_the_denoiser(arch):
    built = _full(arch)
    pipe, config = built.pipe, (built.pipe.unet if arch in ("sd15", "sd2", "sdxl") else built.pipe.transformer).config
    encoders = [pipe.text_encoder, getattr(pipe, "text_encoder_2", None), getattr(pipe, "text_encoder_3", None)]
    clips = [e.config for e in encoders if e is not None and not isinstance(e, T5EncoderModel)]
    t5 = [e.config for e in encoders if isinstance(e, T5EncoderModel)]
    latent = pipe.vae.config.latent_channels
    if arch in ("sd15", "sd2"):
        assert clips[0].hidden_size == config.cross_attention_dim and latent == config.in_channels
    elif arch == "sdxl":
        assert clips[0].hidden_size + clips[1].hidden_size == config.cross_attention_dim
        text_embeds = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        assert clips[1].projection_dim == text_embeds and latent == config.in_channels
    elif arch == "pixart":
        assert t5[0].d_model == config.caption_channels and latent == config.in_channels
    elif arch == "sd3":
        assert clips[0].projection_dim + clips[1].projection_dim == config.pooled_projection_dim
        assert t5[0].d_model == config.joint_attention_dim and latent == config.in_channels
    else:  # flux: 2 x 2 latent patches packed into one token
        assert clips[0].hidden_size == config.pooled_projection_dim and t5[0].d_model == config.joint_attention_dim
        assert 4 * latent == config.in_channels
    assert all(c.max_position_embeddings == 77 for c in clips)
    assert all(t.num_layers == 24 and t.d_model == 4096 for t in t5)
    assert "shape" in built.components["text_encoder"] and "random weights" in built.components["text_encoder"]


def test_small_text_encoders_keep_the_width():
    full, small = _full("sd3").pipe, _full("sd3", "small").pipe
    for name in ("text_encoder", "text_encoder_2"):
        a, b = getattr(full, name).config, getattr(small, name).config
        assert (a.hidden_size, a.projection_dim) == (b.hidden_size, b.projection_dim)
        assert a.num_hidden_layers >= 12 and b.num_hidden_layers == SMALL_TEXT_LAYERS
    a, b = full.text_encoder_3.config, small.text_encoder_3.config
    assert (a.d_model, a.d_ff, a.num_heads) == (b.d_model, b.d_ff, b.num_heads)
    assert a.num_layers == 24 and b.num_layers == SMALL_TEXT_LAYERS
