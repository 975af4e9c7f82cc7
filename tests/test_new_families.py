"""The joint text-image families with rotary positions beyond FLUX.1: Qwen-Image (and Edit), FLUX.2, Chroma, Z-Image.

One table of (name, tiny random-weight model, inputs) feeds the same checks: ToMe merges (the output
changes at 0.5), ratio 0 and removal give the plain model's output bit for bit, merged rows keep their
rotary positions per sample (a batch of two equals two batches of one), and the families' grids and
block lists are what the models hold.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    ChromaPipeline,
    ChromaTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from PIL import Image
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLProcessor,
    Qwen3Config,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
)

import tome_processors as tp
from tome_processors.bench.dit import build_transformer, make_transformer_inputs
from tome_processors.bench.pipelines import write_t5_tokenizer
from tome_processors.cli.main import main
from tome_processors.families import Span, family_of

try:  # transformers' PIL image processor: the default one needs torchvision, which the tests do without
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil as Qwen2VLImageProcessor,
    )
except ImportError:  # transformers before the torchvision/PIL split
    from transformers import Qwen2VLImageProcessor

TEXT = 7  # text tokens: not a multiple of anything, so an off-by-text error shows


def tiny_qwenimage(num_layers: int = 2) -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    ).eval()


def qwenimage_inputs(batch: int = 2, h: int = 6, w: int = 8, reference: tuple[int, int] | None = None) -> dict:
    """As the Qwen-Image pipelines call the model; with `reference`, Qwen-Image-Edit's appended image."""
    generator = torch.Generator().manual_seed(0)
    tokens = h * w + (reference[0] * reference[1] if reference else 0)
    shapes = [(1, h, w), *([(1, *reference)] if reference else [])]
    return {
        "hidden_states": torch.randn(batch, tokens, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "encoder_hidden_states_mask": torch.ones(batch, TEXT, dtype=torch.long),
        "timestep": torch.full((batch,), 0.6),
        "img_shapes": [shapes] * batch,
    }


def ids(h: int, w: int, columns: int) -> torch.Tensor:
    """Packed-token ids as the Flux pipelines build them: rows in column 1, columns in column 2."""
    out = torch.zeros(h, w, columns)
    out[..., 1] = torch.arange(h)[:, None]
    out[..., 2] = torch.arange(w)[None]
    return out.view(h * w, columns)


def tiny_flux2(num_layers: int = 1, num_single_layers: int = 2) -> Flux2Transformer2DModel:
    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    ).eval()


def flux2_inputs(batch: int = 2, h: int = 6, w: int = 8, reference: tuple[int, int] | None = None) -> dict:
    """As `Flux2Pipeline` calls the model; with `reference`, a reference image's tokens after the generated
    image's, at time coordinate 10 (the pipeline's first reference image)."""
    generator = torch.Generator().manual_seed(0)
    text_ids = torch.zeros(TEXT, 4)
    text_ids[:, 3] = torch.arange(TEXT)
    image_ids = ids(h, w, 4)
    if reference is not None:
        reference_ids = ids(*reference, 4)
        reference_ids[:, 0] = 10.0
        image_ids = torch.cat([image_ids, reference_ids])
    return {
        "hidden_states": torch.randn(batch, image_ids.shape[0], 8, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "img_ids": image_ids,
        "txt_ids": text_ids,
    }


def tiny_chroma(num_layers: int = 1, num_single_layers: int = 2) -> ChromaTransformer2DModel:
    torch.manual_seed(0)
    return ChromaTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        approximator_num_channels=8,
        approximator_hidden_dim=16,
        approximator_layers=1,
    ).eval()


def chroma_inputs(batch: int = 2, h: int = 6, w: int = 8, padded: int = 0) -> dict:
    """As ChromaPipeline calls the model; `padded` text tokens masked out (its mask covers text and image)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(batch, h * w, 8, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "img_ids": ids(h, w, 3),
        "txt_ids": torch.zeros(TEXT, 3),
    }
    if padded:
        mask = torch.ones(batch, TEXT + h * w, dtype=torch.bool)
        mask[:, TEXT - padded : TEXT] = False
        inputs["attention_mask"] = mask
    return inputs


def tiny_zimage(n_layers: int = 2) -> ZImageTransformer2DModel:
    torch.manual_seed(0)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=n_layers,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    ).eval()


def zimage_inputs(batch: int = 2, h: int = 6, w: int = 8, text: tuple[int, ...] | None = None) -> dict:
    """As ZImagePipeline calls the model: a latent `(C, 1, H, W)` and a caption per sample, `t` in 0..1."""
    generator = torch.Generator().manual_seed(0)
    lengths = text or (TEXT,) * batch
    return {
        "x": [torch.randn(4, 1, 2 * h, 2 * w, generator=generator) for _ in range(batch)],
        "t": torch.full((batch,), 0.4),
        "cap_feats": [torch.randn(n, 16, generator=generator) for n in lengths],
    }


class Case(NamedTuple):
    build: Callable[[], torch.nn.Module]
    inputs: Callable[..., dict]
    family: str
    merged_blocks: int  # blocks whose attention merges in one forward of the tiny model


CASES = {
    "qwenimage": Case(tiny_qwenimage, qwenimage_inputs, "qwenimage", 2),
    "qwenimage-edit": Case(tiny_qwenimage, lambda **k: qwenimage_inputs(reference=(4, 4), **k), "qwenimage", 2),
    "flux2": Case(tiny_flux2, flux2_inputs, "flux2", 3),
    "flux2-edit": Case(tiny_flux2, lambda **k: flux2_inputs(reference=(4, 4), **k), "flux2", 3),
    "chroma": Case(tiny_chroma, chroma_inputs, "chroma", 3),
    "chroma-masked": Case(tiny_chroma, lambda **k: chroma_inputs(padded=3, **k), "chroma", 3),
    "zimage": Case(tiny_zimage, zimage_inputs, "zimage", 3),
    "zimage-masked": Case(tiny_zimage, lambda **k: zimage_inputs(text=(TEXT, 40), **k), "zimage", 3),
}


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out


def count_merges(model: torch.nn.Module, inputs: dict) -> int:
    """Attention calls that ran on merged tokens in one forward."""
    from tome_processors import joint_attention

    calls = []
    original = joint_attention._call

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joint_attention, "_call", counting)
        run(model, inputs)
    return len(calls)


@pytest.mark.parametrize("case", sorted(CASES))
def test_merges_and_removal_restores_the_model_bit_for_bit(case):
    build, make_inputs, _, merged_blocks = CASES[case]
    model, inputs = build(), make_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    assert count_merges(model, inputs) == merged_blocks
    merged = run(model, inputs)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, plain, atol=1e-4), "ToMe at 0.5 changed nothing"
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), plain)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ratio_zero_is_the_plain_model(case):
    build, make_inputs, _, _ = CASES[case]
    model, inputs = build(), make_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.0)
    assert torch.equal(run(model, inputs), plain)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_sample_keeps_its_own_merge_and_rotary_positions(case):
    # A batch of two (each sample merged on its own, its rows at their own positions) equals two batches of
    # one; `use_rand=False` so both calls draw the same partition.
    build, make_inputs, _, _ = CASES[case]
    model = build()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    both = run(model, make_inputs(batch=2))
    if case == "zimage-masked":  # the samples' captions differ in length: each alone has its own
        pytest.skip("samples of different caption lengths are padded only in a batch")
    single = make_inputs(batch=2)
    for b in range(2):
        one = {k: _sample(v, b) for k, v in single.items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)


def _sample(value, b: int):
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == 2:
        return value[b : b + 1]
    if isinstance(value, list) and len(value) == 2:
        return value[b : b + 1]
    return value


@pytest.mark.parametrize("case", sorted(CASES))
def test_presets_apply_and_merge(case):
    build, make_inputs, family, _ = CASES[case]
    model, inputs = build(), make_inputs()
    plain = run(model, inputs)
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(model, preset=preset)
        out = run(model, inputs)
        assert torch.isfinite(out).all() and not torch.equal(out, plain), preset
    assert family_of(model).name == family


def test_families_find_the_blocks_grid_and_timestep():
    qwen = family_of(tiny_qwenimage())
    assert len(qwen.blocks(tiny_qwenimage())) == 2
    assert qwen.token_grid(None, (), qwenimage_inputs(h=6, w=8, reference=(4, 4))) == (6, 8)
    assert float(qwen.timestep((), qwenimage_inputs(batch=1))[0]) == pytest.approx(600.0)
    chroma = family_of(tiny_chroma())
    sites = chroma.blocks(tiny_chroma())
    assert [s.span for s in sites] == [Span.WHOLE, Span.TRAILING, Span.TRAILING]
    assert chroma.token_grid(tiny_chroma(), (), chroma_inputs(h=5, w=9)) == (5, 9)
    flux2 = family_of(tiny_flux2())
    assert flux2.token_grid(tiny_flux2(), (), flux2_inputs(h=3, w=4)) == (3, 4)
    edit = flux2_inputs(h=3, w=4, reference=(2, 5))  # the generated image's grid; the reference's 10 tokens trail
    assert flux2.token_grid(tiny_flux2(), (), edit) == (3, 4) and flux2.trailing_tokens((), edit, (3, 4)) == 10
    assert [s.span for s in flux2.blocks(tiny_flux2())] == [Span.LEADING, Span.TRAILING, Span.TRAILING]
    zimage = family_of(tiny_zimage())
    assert len(zimage.blocks(tiny_zimage())) == 3  # the noise refiner's and the main layers; not the caption's
    assert zimage.token_grid(None, (), zimage_inputs(h=5, w=7)) == (5, 7)
    # Z-Image's t rises towards the clean image: ToMe's timestep is the noise level on 0..1000.
    assert float(zimage.timestep((), zimage_inputs(batch=1))[0]) == pytest.approx(600.0)


def _merges_of_a_forward(model: torch.nn.Module, inputs: dict) -> list:
    """`(rows the attention saw, the merge)` of every merged joint attention call of one forward with ToMe 0.5."""
    from tome_processors import joint_attention

    tp.apply_tome(model, ratio=0.5)
    seen = []
    original = joint_attention._call

    def recording(inner, attn, merged, args, kwargs, merge, spec, *where):
        seen.append((merged.shape[1], merge))
        return original(inner, attn, merged, args, kwargs, merge, spec, *where)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joint_attention, "_call", recording)
        run(model, inputs)
    return seen


def test_qwenimage_edit_never_merges_the_reference_image():
    # The reference image's tokens pass through as rows of their own: each comes out of merge and unmerge
    # as it went in, whatever the generated image's tokens do.
    model, inputs = tiny_qwenimage(), qwenimage_inputs(reference=(4, 4))
    seen = _merges_of_a_forward(model, inputs)
    assert seen
    reference = inputs["hidden_states"][:, 48:]
    for rows, merge in seen:
        assert rows == 48 - int(48 * 0.5) + 16
        x = torch.randn(2, 64, 5)
        x[:, 48:, :1] = reference[..., :1]
        out = merge.unmerge(merge.merge(x))
        assert torch.equal(out[:, 48:], x[:, 48:])
        assert not torch.equal(out[:, :48], x[:, :48])


def test_flux2_edit_never_merges_the_reference_image():
    # FLUX.2's reference tokens follow the generated image's: in the double-stream blocks' image input and after
    # text and image in the single-stream blocks'. They pass through as rows of their own in both.
    model, inputs = tiny_flux2(), flux2_inputs(reference=(4, 4))
    seen = _merges_of_a_forward(model, inputs)
    kept = 48 - int(48 * 0.5)
    assert [rows for rows, _ in seen] == [kept + 16, TEXT + kept + 16, TEXT + kept + 16]  # 1 double, 2 single
    for rows, merge in seen:
        lead = rows - kept - 16  # the single-stream blocks' text
        x = torch.randn(2, lead + 48 + 16, 5)
        out = merge.unmerge(merge.merge(x))
        assert torch.equal(out[:, lead + 48 :], x[:, lead + 48 :]) and torch.equal(out[:, :lead], x[:, :lead])
        assert not torch.equal(out[:, lead : lead + 48], x[:, lead : lead + 48])


def test_flux2_merges_nothing_where_reference_tokens_lead():
    # Tokens at time coordinate 0 after a reference's are no leading grid: nothing is merged, and a warning says so.
    model, inputs = tiny_flux2(), flux2_inputs(reference=(4, 4))
    inputs["img_ids"] = inputs["img_ids"].roll(16, 0)
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    with pytest.warns(UserWarning, match="ToMe merges nothing in this Flux2Transformer2DModel call"):
        assert torch.equal(run(model, inputs), plain)


def test_a_text_mask_is_cut_to_the_merged_sequence():
    # Chroma masks the prompt's padding: with ToMe the padded text stays masked. Changing what sits in the
    # masked text tokens must not change the output, with or without ToMe.
    model = tiny_chroma()
    tp.apply_tome(model, ratio=0.5)
    inputs = chroma_inputs(padded=3)
    out = run(model, inputs)
    changed = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][:, TEXT - 3 :] += 5.0
    torch.testing.assert_close(run(model, changed), out, rtol=1e-4, atol=1e-5)


def test_apply_tome_refuses_k_v_pooling_on_the_joint_families():
    for build in (tiny_qwenimage, tiny_flux2, tiny_chroma, tiny_zimage):
        with pytest.raises(ValueError, match='Expected mode="merge"'):
            tp.apply_tome(build(), mode="downsample_kv")


# ---------------------------------------------------------------- pipelines (tiny, offline)


def byte_symbols() -> list[str]:
    """The 256 printable characters byte-level BPE writes bytes as (printable bytes stand for themselves)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    table = {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [table[b] for b in range(256)]


def write_qwen_tokenizer(folder: Path) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer of Qwen's class over single bytes (no merges), with a plain chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols())}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    return tokenizer


def tiny_flow_vae(latent_channels: int) -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=0.36,
        shift_factor=0.11,
    ).eval()


def tiny_chroma_pipeline(tmp_path: Path) -> tuple[ChromaPipeline, dict]:
    tokenizer = write_t5_tokenizer(tmp_path / "t5")
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    ).eval()
    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
        approximator_hidden_dim=16, approximator_layers=1,
    ).eval()  # fmt: skip
    pipe = ChromaPipeline(FlowMatchEulerDiscreteScheduler(), tiny_flow_vae(4), text_encoder, tokenizer, transformer)
    pipe.set_progress_bar_config(disable=True)
    # A short prompt padded to 16 tokens: the model gets a mask over the padding (cut, not refused, by ToMe).
    return pipe, {"prompt": "a cat", "negative_prompt": "dark", "guidance_scale": 3.0, "max_sequence_length": 16}


def tiny_zimage_pipeline(tmp_path: Path) -> tuple[ZImagePipeline, dict]:
    tokenizer = write_qwen_tokenizer(tmp_path / "qwen")
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=64,
    )  # fmt: skip
    text_encoder = Qwen3Model(config).eval()
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    ).eval()  # fmt: skip
    with torch.no_grad():  # made with torch.empty: fixed so that no NaN comes out of uninitialised memory
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    pipe = ZImagePipeline(FlowMatchEulerDiscreteScheduler(), tiny_flow_vae(16), text_encoder, tokenizer, transformer)
    pipe.set_progress_bar_config(disable=True)
    # Prompt and negative prompt of different lengths: the guidance batch's captions are padded and masked.
    return pipe, {
        "prompt": "a cat on a mat",
        "negative_prompt": "dark",
        "guidance_scale": 3.0,
        "max_sequence_length": 32,
    }


def tiny_qwenimage_pipeline(tmp_path: Path) -> tuple[QwenImagePipeline, dict]:
    tokenizer = write_qwen_tokenizer(tmp_path / "qwen")
    torch.manual_seed(0)
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, hidden_size=16, vocab_size=152064, vision_end_token_id=151653,
        vision_start_token_id=151652, vision_token_id=151654,
    )  # fmt: skip
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()  # fmt: skip
    transformer = tiny_qwenimage()
    pipe = QwenImagePipeline(FlowMatchEulerDiscreteScheduler(), vae, text_encoder, tokenizer, transformer)
    pipe.set_progress_bar_config(disable=True)
    # True classifier-free guidance: one model call per branch, each with its own text length.
    return pipe, {
        "prompt": "a cat on a mat",
        "negative_prompt": "dark",
        "true_cfg_scale": 2.0,
        "max_sequence_length": 16,
    }


def tiny_flux2_pipeline(tmp_path: Path) -> tuple[Flux2Pipeline, dict]:
    """FLUX.2 [dev]'s pipeline, random weights: Mistral 3 (one text layer; its hidden states are taken from
    layer 1 instead of 10, 20 and 30), the one-level FLUX.2 VAE of diffusers' own tests (32 px: 16 x 16 tokens)
    and guidance embedded. The tokenizer is `write_qwen_tokenizer`'s with a chat template over the messages'
    text parts: the pipeline only calls its `apply_chat_template`, and the real component, a `PixtralProcessor`,
    needs torchvision."""
    tokenizer = write_qwen_tokenizer(tmp_path / "mistral")
    tokenizer.chat_template = (
        "{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
    )
    last = len(tokenizer) - 1  # <|endoftext|>: begin, end and padding
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=37,
                num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_hidden_layers=1,
                max_position_embeddings=64, sliding_window=None, bos_token_id=last, eos_token_id=last,
                pad_token_id=last)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=37, image_size=30, patch_size=6)  # fmt: skip
    torch.manual_seed(0)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=len(tokenizer))
    text_encoder = Mistral3ForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,), layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()  # fmt: skip
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
    ).eval()  # fmt: skip
    pipe = Flux2Pipeline(FlowMatchEulerDiscreteScheduler(), vae, text_encoder, tokenizer, transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe, {
        "prompt": "a cat",
        "guidance_scale": 4.0,
        "max_sequence_length": 16,
        "text_encoder_out_layers": (1,),
        "height": 32,
        "width": 32,
    }


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without its video processor: the constructor checks every sub-processor's class, and the
    video processors' needs torchvision. Images and text are processed as the real processor does."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


#: Qwen-Image-Edit's prompt template with a one-word system prompt (the real one is 64 tokens long).
QWEN_EDIT_TEMPLATE = (
    "<|im_start|>system\nEdit.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)


def tiny_qwenimage_edit_pipeline(tmp_path: Path) -> tuple[QwenImageEditPipeline, dict]:
    """Qwen-Image-Edit, random weights: Qwen2.5-VL reading the prompt and the image to edit (its vision tower
    sees the image at 56 x 56 px: 4 image tokens), the Qwen-Image VAE at 16x compression (the pipeline resizes
    the image to about 1024 x 1024 px before encoding it: 32 x 32 reference tokens) and `tiny_qwenimage`.
    Generations are 128 x 128 px (4 x 4 tokens) with true classifier-free guidance."""
    tokenizer = write_qwen_tokenizer(tmp_path / "qwen")
    vision_tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    start, image, end, video = tokenizer.convert_tokens_to_ids(vision_tokens)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56)
    processor = ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, hidden_size=16, vocab_size=len(tokenizer),
        vision_start_token_id=start, image_token_id=image, vision_end_token_id=end, video_token_id=video,
    )  # fmt: skip
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=2, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0, temperal_downsample=[False, True, True, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()  # fmt: skip
    pipe = QwenImageEditPipeline(
        FlowMatchEulerDiscreteScheduler(), vae, text_encoder, tokenizer, processor, tiny_qwenimage()
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template_encode = QWEN_EDIT_TEMPLATE
    system = QWEN_EDIT_TEMPLATE.split("<|vision_start|>")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(system).input_ids)  # cropped as the pipeline crops its own
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return pipe, {
        "image": Image.fromarray(pixels),
        "prompt": "make it red",
        "negative_prompt": "dark",
        "true_cfg_scale": 2.0,
        "max_sequence_length": 16,
        "height": 128,
        "width": 128,
    }


PIPELINES = {"chroma": tiny_chroma_pipeline, "qwenimage": tiny_qwenimage_pipeline, "zimage": tiny_zimage_pipeline}


def generate(pipe, args: dict) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return pipe(**args, height=32, width=32, num_inference_steps=2, generator=generator, output_type="pt").images


@pytest.fixture
def patched():
    tp.patch_pipelines()
    yield
    tp.unpatch_pipelines()


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipelines_apply_tome_and_enable_tome(name, tmp_path, patched):
    pipe, args = PIPELINES[name](tmp_path)
    plain = generate(pipe, args)
    assert torch.isfinite(plain).all()

    tp.apply_tome(pipe, ratio=0.5)
    first, second = generate(pipe, args), generate(pipe, args)
    assert torch.isfinite(first).all() and torch.equal(first, second)
    assert not torch.allclose(first, plain, atol=1e-5)
    tp.remove_tome(pipe)
    assert torch.equal(generate(pipe, args), plain)

    pipe.enable_tome(preset="fast")
    first, second = generate(pipe, args), generate(pipe, args)
    assert torch.isfinite(first).all() and torch.equal(first, second)
    assert not torch.allclose(first, plain, atol=1e-5)
    pipe.disable_tome()
    assert not tp.is_tome_applied(pipe)
    assert torch.equal(generate(pipe, args), plain)


# ---------------------------------------------------------------- the bench's architectures


@pytest.mark.parametrize("arch", ["qwenimage", "flux2", "chroma", "zimage"])
def test_bench_builds_each_architecture_with_fewer_layers(arch):
    model = build_transformer(arch, quick=True, layers=1)
    depth = [
        getattr(model.config, name) for name in ("num_layers", "num_single_layers", "n_layers") if name in model.config
    ]
    assert depth and all(d == 1 for d in depth)
    assert family_of(model).name == arch
    inputs = make_transformer_inputs(model, arch, batch=2, resolution=64, text_tokens=5)
    plain = inputs.run(model)
    tp.apply_tome(model, ratio=0.5)
    merged = inputs.run(model)
    assert merged.shape == plain.shape and not torch.equal(merged, plain)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--arch", "svd", "--layers", "2"],
            "Expected --layers with a diffusion-transformer --arch or sd15, sd2, sdxl",
        ),
        (["--arch", "zimage", "--layers", "0"], "Expected --layers >= 1"),
        (["--arch", "ltx2", "--pipeline"], "Expected --pipeline with sd15"),
    ],
)
def test_bench_refuses_layers_and_pipelines_it_cannot_build(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
