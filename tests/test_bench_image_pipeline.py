"""`tome-processors bench --pipeline --arch qwenimage|flux2|chroma|zimage`: whole generations on random-weight
`QwenImagePipeline`, `Flux2Pipeline`, `ChromaPipeline` and `ZImagePipeline`.

Every run here is `--quick` (tiny components), 2 steps, at 64 px: seconds each. No timing assertions: quick-CPU
timings of tiny models are host-bound. The full-size components are built on the meta device (shapes only).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    ChromaPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    QwenImagePipeline,
    ZImagePipeline,
)
from diffusers.pipelines.flux2.pipeline_flux2 import format_input
from transformers import (
    Mistral3ForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Model,
    T5EncoderModel,
)

from tome_processors.bench import run as bench_run
from tome_processors.bench.caches import cache_quality
from tome_processors.bench.dit import build_transformer
from tome_processors.bench.generate import DEFAULT_PROMPT, DenoiserTimer
from tome_processors.bench.image_pipelines import build_image_pipeline, write_bpe_tokenizer
from tome_processors.bench.models import cast
from tome_processors.bench.pipelines import SMALL_TEXT_LAYERS
from tome_processors.bench.run import BenchRequest, run_bench
from tome_processors.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--pipeline", "--quick", "--steps", "2", "--resolution", "64", "--rounds", "1", "--threads", "1"]
FAST += ["--no-progress", "--no-memory"]
SECONDS = ("seconds_per_image", "speedup_per_image", "seconds_per_step", "speedup_per_step")
#: arch -> (pipeline class, denoiser calls in 2 steps, the batch of each): Qwen-Image and Chroma run the
#: unconditional forward apart (true CFG), Z-Image batches it (a list of two latents), FLUX.2's guidance is an input.
EXPECTED = {
    "qwenimage": (QwenImagePipeline, 4, 1),
    "flux2": (Flux2Pipeline, 2, 1),
    "chroma": (ChromaPipeline, 4, 1),
    "zimage": (ZImagePipeline, 2, 2),
}


def run_cli(tmp_path, *argv: str) -> dict:
    path = tmp_path / "p.json"
    assert main(["bench", *FAST, *argv, "--json", str(path), "--grid", str(tmp_path / "grid.png")]) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_each_pipeline_times_whole_images_for_the_baseline_and_the_presets(arch, tmp_path, capsys):
    data = run_cli(tmp_path, "--arch", arch)
    pipeline, calls, batch = EXPECTED[arch]
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows)[0] == "baseline" and {"ours balanced", "ours fast"} <= {n.split(" r=")[0] for n in rows}
    assert any(name.startswith("ours exact") for name in rows)
    for row in rows.values():
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in SECONDS), row["name"]
        assert row["denoiser_calls"] == calls and row["seconds_per_step"] < row["seconds_per_image"]
    assert rows["baseline"]["image_change"] == 0.0
    assert all(row["image_change"] > 0 for name, row in rows.items() if name != "baseline")  # each merges
    meta = data["meta"]
    assert meta["pipeline"] == pipeline.__name__ and meta["batch"] == batch
    assert set(meta["components"]) == {"transformer", "text_encoder", "tokenizer", "vae", "scheduler"}
    assert "tiny" in meta["components"]["text_encoder"]
    table = capsys.readouterr().out
    assert "| method | ratio | s/image | speed-up/image |" in table and "| baseline | - |" in table


def test_qwen_image_with_first_block_cache(tmp_path, monkeypatch):
    # The cache quality table runs whole samplings of the trained FLUX-shaped model: 2 steps here, not 20.
    monkeypatch.setattr(
        bench_run, "cache_quality", lambda name, methods, **options: cache_quality(name, methods, steps=2, **options)
    )
    data = run_cli(tmp_path, "--arch", "qwenimage", "--cache", "fbc", "--presets", "balanced")
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows) == ["baseline", "ours balanced r=0.5", "FirstBlockCache", "FirstBlockCache + ours balanced r=0.5"]
    assert all(all(math.isfinite(row[key]) for key in SECONDS) for row in rows.values())
    assert data["meta"]["call_arguments"] == {"negative_prompt": " ", "true_cfg_scale": 4.0, "guidance_scale": None}


@pytest.mark.parametrize(
    "arch, message", [("flux2", "opens a cache context"), ("chroma", "opens a cache context"), ("zimage", "CacheMixin")]
)
def test_caches_are_refused_where_the_pipeline_cannot_run_them(arch, message):
    request = BenchRequest(arch=arch, quick=True, pipeline=True, cache="fbc", resolution=64, rounds=1)
    with pytest.raises(ValueError, match=message):
        run_bench(request)


def _full(arch: str, text_encoders: str = "full"):
    """The full-size pipeline on the meta device: shapes only, no memory, no weights."""
    denoiser = build_transformer(arch, device="meta", dtype=torch.bfloat16)
    return build_image_pipeline(denoiser, arch, text_encoders=text_encoders, device="meta", dtype=torch.bfloat16)


def _count(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e9


def test_full_size_text_encoders_are_the_real_ones_and_fit_the_transformer():
    qwen = _full("qwenimage").pipe
    text = qwen.text_encoder.config.text_config
    assert isinstance(qwen.text_encoder, Qwen2_5_VLForConditionalGeneration)
    assert isinstance(qwen.tokenizer, Qwen2Tokenizer) and text.num_hidden_layers == 28
    assert text.hidden_size == qwen.transformer.config.joint_attention_dim == 3584
    assert 8.2 < _count(qwen.text_encoder) < 8.4  # Qwen2.5-VL-7B with its vision tower: 8.29 B
    flux2 = _full("flux2").pipe
    text = flux2.text_encoder.config.text_config
    assert isinstance(flux2.text_encoder, Mistral3ForConditionalGeneration) and text.num_hidden_layers == 40
    assert 3 * text.hidden_size == flux2.transformer.config.joint_attention_dim  # hidden states 10, 20, 30
    assert 23.9 < _count(flux2.text_encoder) < 24.1  # Mistral-Small-3.1-24B
    chroma = _full("chroma").pipe
    assert isinstance(chroma.text_encoder, T5EncoderModel)
    assert chroma.text_encoder.config.d_model == chroma.transformer.config.joint_attention_dim == 4096
    zimage = _full("zimage").pipe
    assert isinstance(zimage.text_encoder, Qwen3Model) and zimage.text_encoder.config.num_hidden_layers == 36
    assert zimage.text_encoder.config.hidden_size == zimage.transformer.config.cap_feat_dim == 2560
    assert 3.9 < _count(zimage.text_encoder) < 4.1  # Qwen3-4B without its head
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in flux2.text_encoder.parameters())  # made in place


@pytest.mark.parametrize(
    "arch, vae_class, latents, packed",
    [
        ("qwenimage", AutoencoderKLQwenImage, 16, 4),
        ("flux2", AutoencoderKLFlux2, 32, 4),
        ("chroma", AutoencoderKL, 16, 4),
        ("zimage", AutoencoderKL, 16, 1),  # Z-Image patchifies inside the transformer
    ],
)
def test_full_size_vae_and_scheduler(arch, vae_class, latents, packed):
    built = _full(arch)
    pipe = built.pipe
    channels = pipe.vae.config.z_dim if arch == "qwenimage" else pipe.vae.config.latent_channels
    assert isinstance(pipe.vae, vae_class) and channels == latents
    assert packed * channels == pipe.transformer.config.in_channels
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipe.scheduler.config.use_dynamic_shifting == (arch != "zimage")
    assert "shape" in built.components["text_encoder"] and "shape" in built.components["vae"]


def test_small_text_encoders_keep_the_width_with_two_layers():
    for arch in ("qwenimage", "flux2", "zimage"):
        full, small = _full(arch).pipe.text_encoder.config, _full(arch, "small").pipe.text_encoder.config
        full, small = getattr(full, "text_config", full), getattr(small, "text_config", small)
        assert small.hidden_size == full.hidden_size and small.num_hidden_layers == SMALL_TEXT_LAYERS, arch
    built = _full("flux2", "small")
    assert built.call_kwargs == {"text_encoder_out_layers": (0, 1, 2)}  # every hidden state of 2 layers
    assert _full("chroma", "small").pipe.text_encoder.config.num_layers == SMALL_TEXT_LAYERS


def test_qwen_image_drops_exactly_its_system_prompt(tmp_path):
    # Qwen-Image drops the first 34 tokens of the encoded template: its system prompt. The tokenizer learns the
    # template's words, so those 34 are the system prompt here too and the prompt's words stay one token each.
    pipe = build_image_pipeline(build_transformer("qwenimage", quick=True), "qwenimage", quick=True).pipe
    ids = pipe.tokenizer(pipe.prompt_template_encode.format(DEFAULT_PROMPT)).input_ids
    tokens = pipe.tokenizer.convert_ids_to_tokens(ids)
    assert tokens[pipe.prompt_template_encode_start_idx - 3 :][:5] == ["<|im_start|>", "user", "Ċ", "a", "Ġphoto"]
    assert len(tokens) == 34 + len(DEFAULT_PROMPT.split()) + 5  # "<|im_end|>", "\n", "<|im_start|>assistant\n"


def test_flux2_tokenizer_pads_the_chat_to_512_tokens():
    pipe = build_image_pipeline(build_transformer("flux2", quick=True), "flux2", quick=True).pipe

    def chat(prompt: str) -> list[str]:
        inputs = pipe.tokenizer.apply_chat_template(
            format_input([prompt], system_message=pipe.system_message),
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=512,
        )
        assert inputs["input_ids"].shape == (1, 512)
        kept = int(inputs["attention_mask"].sum())
        return pipe.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0, :kept].tolist())

    tokens = chat(DEFAULT_PROMPT)
    assert tokens[:3] == ["<s>", "[SYSTEM_PROMPT]", "You"] and tokens[-1] == "[/INST]"
    prompt = tokens[tokens.index("[INST]") + 1 : -1]
    assert prompt == ["a", "Ġphoto", "Ġof", "Ġan", "Ġastronaut", "Ġriding", "Ġa", "Ġhorse", "Ġon", "Ġmars"]
    assert len(chat("a red fox")) > len(tokens) - len(prompt) + 3  # words it never saw fall back to pieces


def test_bpe_tokenizer_refuses_an_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="Expected kind 'qwen' or 'mistral'"):
        write_bpe_tokenizer(tmp_path, ["a cat"], kind="gemma")


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer and every tensor kept as a plain attribute (rotary tables), by name."""
    found = {f"buffer {name}": buffer for name, buffer in model.named_buffers()}
    for module_name, module in model.named_modules():
        found.update({f"{module_name}.{k}": v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
    return found


@pytest.mark.parametrize("arch", ["qwenimage", "flux2", "chroma", "zimage"])
def test_a_transformer_made_in_place_has_the_tables_of_a_cast_one(arch):
    # `constructed_on` sets the default dtype: a table the constructor computed in it would be made in bfloat16
    # rather than cast from float32. These constructors give every table its dtype: the same tensors either way.
    in_place = build_transformer(arch, quick=True, device="cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in in_place.parameters())
    made, cast_after = (
        _tensors(cast(in_place, "cpu", torch.bfloat16)),
        _tensors(cast(build_transformer(arch, quick=True), "cpu", torch.bfloat16)),
    )
    assert made.keys() == cast_after.keys()
    assert all(made[k].dtype == cast_after[k].dtype and torch.equal(made[k], cast_after[k]) for k in made)
    assert torch.get_default_dtype() == torch.float32


def test_denoiser_timer_reads_the_batch_of_a_list_of_latents():
    seen = []
    layer = torch.nn.Module()
    layer.forward = lambda x: seen.append(len(x))
    with DenoiserTimer(layer) as timer:
        layer([torch.ones(4, 1, 2, 2), torch.ones(4, 1, 2, 2)])  # Z-Image: one latent per image
    assert timer.batch == 2 and seen == [2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pipeline", "--arch", "qwenimage", "--resolution", "72"], "multiple of 16"),
        (["--pipeline", "--arch", "qwenimage", "--steps", "1"], "--steps >= 2 for the qwenimage pipeline"),
        (["--pipeline", "--arch", "ltx2"], "but got --arch ltx2"),
        (["--pipeline", "--arch", "hunyuanvideo"], "but got --arch hunyuanvideo"),
    ],
)
def test_bad_options_exit_2_before_anything_is_built(argv, message, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("built a model for options that cannot run")

    monkeypatch.setattr(bench_run, "build_model", refuse)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
