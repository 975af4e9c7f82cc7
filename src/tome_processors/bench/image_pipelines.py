"""Random-weight pipelines of the newer image transformers: `bench --pipeline --arch qwenimage|flux2|chroma|zimage`.

The counterpart of `pipelines.py` for Qwen-Image, FLUX.2-dev, Chroma1-HD and Z-Image: every component of the
real pipeline built offline around the bench's transformer (`dit.py`), random weights:

- the text encoder of the real class and shape: Qwen2.5-VL-7B (`Qwen2_5_VLForConditionalGeneration`, its
  vision tower too) for Qwen-Image, Mistral-Small-3.1-24B (`Mistral3ForConditionalGeneration`) for FLUX.2,
  T5 v1.1 XXL's encoder for Chroma, Qwen3-4B (`Qwen3Model`) for Z-Image; `text_encoders="small"` keeps the
  width (what the transformer reads) with `SMALL_TEXT_LAYERS` layers (FLUX.2 then reads hidden states 0, 1
  and 2 in place of 10, 20 and 30);
- a byte-level BPE tokenizer made here with the `tokenizers` library, trained on the text the pipeline
  sends (its prompt template or system message, and the prompt), so that those words are one token each as
  in the real vocabularies and the real template lengths hold (Qwen-Image drops exactly the 34 tokens of its
  system prompt); other text falls back to bytes. Qwen's in `Qwen2Tokenizer`; Mistral's in a
  `PreTrainedTokenizerFast` with a chat template, in place of FLUX.2's `PixtralProcessor` (it needs
  torchvision, and only its tokenizer runs for text to image); Chroma's T5 is `pipelines.write_t5_tokenizer`;
- the VAE of the real shape: Qwen-Image's (`AutoencoderKLQwenImage`), FLUX.2's (`AutoencoderKLFlux2`, 32
  latent channels), FLUX.1's for Chroma and Z-Image;
- `FlowMatchEulerDiscreteScheduler` with the published settings.

Each weight is made where it will run, in its dtype (`meta.constructed_on`): Mistral-Small alone is 96 GB in
float32. `quick=True` makes every component tiny. No IP-Adapter image encoder for Chroma.

Example:
    >>> from tome_processors.bench.dit import build_transformer
    >>> built = build_image_pipeline(build_transformer("zimage", quick=True), "zimage", quick=True)
    >>> type(built.pipe).__name__, type(built.pipe.text_encoder).__name__
    ('ZImagePipeline', 'Qwen3Model')
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from .dit import QUICK_TEXT_TOKENS
from .generate import DEFAULT_PROMPT
from .meta import constructed_on
from .pipelines import (
    FLUX_SCHEDULER,
    FLUX_VAE,
    SMALL_TEXT_LAYERS,
    T5_XXL,
    TEXT_ENCODER_SIZES,
    TINY_VAE,
    RandomPipeline,
    write_t5_tokenizer,
)

__all__ = ["IMAGE_PIPELINE_ARCHITECTURES", "build_image_pipeline", "write_bpe_tokenizer"]

# Qwen2.5-VL-7B-Instruct (Qwen-Image's text encoder): its language model and vision tower.
_QWEN25_VL_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
)
_QWEN25_VL_7B_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    fullatt_block_indexes=[7, 15, 23, 31],
)
# Mistral-Small-3.1-24B (FLUX.2-dev's text encoder; 3.2 has the same shape): language model and Pixtral tower.
_MISTRAL_SMALL = dict(
    vocab_size=131072,
    hidden_size=5120,
    intermediate_size=32768,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e9},
)
_PIXTRAL = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    head_dim=64,
    patch_size=14,
    image_size=1540,
)
# Qwen3-4B (Z-Image's text encoder, its base model without the language-model head).
_QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                 tie_word_embeddings=True)  # fmt: skip

_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
#: Qwen3's chat template for one user turn (Z-Image asks for the generation prompt, thinking enabled: no
#: empty think block).
_QWEN3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
#: Mistral-Small's chat template for a system message and a user turn whose contents are text parts (FLUX.2's).
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' + text + '[/INST]' }}{% else %}{{ text + eos_token }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class _ImagePipeline:
    """What `build_image_pipeline` builds for one architecture."""

    pipeline: str  # the class, by its name in diffusers' lazy namespace (`pipelines.py` says why)
    encoder_label: str
    encoder_layers: int  # the real encoder's depth
    scheduler: dict[str, Any]
    scheduler_label: str
    vae_label: str


_ARCHITECTURES: dict[str, _ImagePipeline] = {
    "qwenimage": _ImagePipeline(
        "QwenImagePipeline", "Qwen2.5-VL-7B", 28,
        dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
             base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"),
        "Qwen-Image's dynamic shift", "Qwen-Image VAE",
    ),
    "flux2": _ImagePipeline(
        "Flux2Pipeline", "Mistral-Small-3.1-24B", 40,
        dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
             base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential"),
        "dynamic shift, the pipeline's empirical mu (FLUX.2-dev)", "FLUX.2 VAE",
    ),
    "chroma": _ImagePipeline(
        "ChromaPipeline", "T5 v1.1 XXL encoder", 24, FLUX_SCHEDULER,
        "FLUX.1's dynamic shift (Chroma1-HD)", "Flux VAE",
    ),
    "zimage": _ImagePipeline(
        "ZImagePipeline", "Qwen3-4B", 36, dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
        "shift 3.0 (Z-Image-Turbo)", "Flux VAE",
    ),
}  # fmt: skip
#: Architectures `build_image_pipeline` knows (`--arch` with `--pipeline`).
IMAGE_PIPELINE_ARCHITECTURES = tuple(_ARCHITECTURES)
#: The Mistral hidden states FLUX.2 stacks into its text features, by text-encoder size: the real pipeline's 10,
#: 20 and 30 of 40; all three of a 2-layer one (`text_encoders="small"`); two of width 16 for the `--quick`
#: transformer's 32.
_FLUX2_LAYERS = {"full": (10, 20, 30), "small": (0, 1, 2), "quick": (1, 2)}


def write_bpe_tokenizer(
    folder: str | Path,
    texts: list[str],
    kind: str = "qwen",
    chat_template: str | None = None,
) -> Any:
    """A byte-level BPE tokenizer trained on `texts`, saved to `folder` and loaded from it.

    Its pre-tokenizer is Qwen2's (words with their leading space, digits alone), so every word of `texts` is one
    token, as the real vocabularies have whole common English words; any other text is split into bytes.
    `kind` `"qwen"`: a `Qwen2Tokenizer` (`<|endoftext|>` pads, `<|im_start|>` and `<|im_end|>` special);
    `"mistral"`: a `PreTrainedTokenizerFast` with Mistral's special tokens (`<s>`, `</s>`, `<pad>`, `[INST]`,
    `[SYSTEM_PROMPT]`, ...).

    Example:
        >>> import tempfile
        >>> tokenizer = write_bpe_tokenizer(tempfile.mkdtemp(), ["a photo of a cat"])
        >>> tokenizer.convert_ids_to_tokens(tokenizer("<|im_start|>a photo of a dog").input_ids)
        ['<|im_start|>', 'a', 'Ġphoto', 'Ġof', 'Ġa', 'Ġ', 'd', 'o', 'g']
    """
    if kind not in ("qwen", "mistral"):
        raise ValueError(f"Expected kind 'qwen' or 'mistral', but got {kind!r}.")
    specials = _QWEN_SPECIALS if kind == "qwen" else _MISTRAL_SPECIALS
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated")
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([split, to_bytes])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1 << 20,  # no limit: merge until every word is one token
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The text between special tokens, as the tokenizer will see it: they cut the input before pre-tokenization.
    pieces = re.split("|".join(re.escape(special) for special in specials), "\n".join(texts))
    backend.train_from_iterator([piece for piece in pieces if piece], trainer)
    if kind == "qwen":  # the real class builds its own BPE (Qwen2's pre-tokenizer) from the vocabulary and merges
        merges = [tuple(pair) for pair in json.loads(backend.to_str())["model"]["merges"]]
        tokenizer: Any = Qwen2Tokenizer(vocab=backend.get_vocab(), merges=merges, chat_template=chat_template)
        tokenizer.add_tokens(specials[1:], special_tokens=True)
        loader: Any = Qwen2Tokenizer
    else:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            extra_special_tokens=specials[4:],
            chat_template=chat_template,
        )
        loader = PreTrainedTokenizerFast
    tokenizer.save_pretrained(folder)
    return loader.from_pretrained(folder)


def _tiny_text(width: int, vocab_size: int) -> dict[str, Any]:
    """A 2-layer decoder of `width` (2 heads, 1 key-value head) over `vocab_size` tokens (the real special ids lie
    beyond it)."""
    return dict(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2, bos_token_id=None,
                eos_token_id=None)  # fmt: skip


def _text_encoder_config(arch: str, width: int, vocab_size: int, quick: bool, small: bool) -> Any:
    """The text encoder's config: the real one, its width with `SMALL_TEXT_LAYERS` layers, or a tiny one of `width`
    (the `--quick` transformer's text width) over the tokenizer's `vocab_size`."""
    layers = {"num_hidden_layers": SMALL_TEXT_LAYERS} if small else {}
    if arch == "chroma":
        shape = dict(T5_XXL, num_layers=SMALL_TEXT_LAYERS) if small else dict(T5_XXL)
        if quick:
            shape.update(d_model=width, d_kv=8, d_ff=2 * width, num_layers=2, num_heads=4, vocab_size=vocab_size)
        return T5Config(**shape, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if arch == "zimage":
        return Qwen3Config(**(dict(_QWEN3_4B, **_tiny_text(width, vocab_size)) if quick else dict(_QWEN3_4B, **layers)))
    if arch == "qwenimage":
        text, vision = dict(_QWEN25_VL_7B, **layers), dict(_QWEN25_VL_7B_VISION)
        if small:
            vision.update(depth=SMALL_TEXT_LAYERS, fullatt_block_indexes=[SMALL_TEXT_LAYERS - 1])
        if quick:  # rotary sections of a 16-wide head: 8 frequencies
            text.update(
                _tiny_text(width, vocab_size), rope_parameters=dict(text["rope_parameters"], mrope_section=[2, 3, 3])
            )
            del text["head_dim"]
            vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=width,
                          fullatt_block_indexes=[0])  # fmt: skip
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    text, vision = dict(_MISTRAL_SMALL, **layers), dict(_PIXTRAL)  # flux2
    if small:
        vision["num_hidden_layers"] = SMALL_TEXT_LAYERS
    if quick:
        text.update(_tiny_text(width, vocab_size))
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                      patch_size=14, image_size=28)  # fmt: skip
    return Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


_ENCODER_CLASSES: dict[str, type] = {
    "qwenimage": Qwen2_5_VLForConditionalGeneration,
    "flux2": Mistral3ForConditionalGeneration,
    "chroma": T5EncoderModel,
    "zimage": Qwen3Model,
}


def _vae(arch: str, quick: bool, latent_channels: int) -> torch.nn.Module:
    """The architecture's VAE: the real one's shape (diffusers' defaults are Qwen-Image's and FLUX.2's; Chroma and
    Z-Image use FLUX.1's), or a tiny one with the real strides and `latent_channels` (the `--quick` transformer's)."""
    if arch == "qwenimage":
        if not quick:
            return AutoencoderKLQwenImage().eval()
        flat = dict(latents_mean=[0.0] * latent_channels, latents_std=[1.0] * latent_channels)
        return AutoencoderKLQwenImage(base_dim=8, z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                      **flat).eval()  # fmt: skip
    tiny = dict(TINY_VAE, latent_channels=latent_channels)
    if arch == "flux2":
        return (AutoencoderKLFlux2(**tiny) if quick else AutoencoderKLFlux2()).eval()
    return AutoencoderKL(**(dict(FLUX_VAE, **tiny) if quick else FLUX_VAE)).eval()


def _corpus(arch: str, pipe: Any, prompt: str) -> list[str]:
    """The text the pipeline sends to its tokenizer: its prompt template or system message, and the prompt."""
    if arch == "qwenimage":
        return [pipe.prompt_template_encode.format(prompt)]
    if arch == "flux2":
        return [pipe.system_message, prompt]
    return [f"user\n{prompt}", "assistant\n"]  # Z-Image: one user turn of Qwen3's chat


def build_image_pipeline(
    denoiser: torch.nn.Module,
    arch: str,
    quick: bool = False,
    text_encoders: str = "full",
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    prompt: str = DEFAULT_PROMPT,
) -> RandomPipeline:
    """The text-to-image pipeline of `arch` around `denoiser` (the bench's transformer), random weights.

    Args:
        denoiser: the bench's transformer of that architecture (`--quick`: the tiny one); it is not copied.
        arch: `qwenimage`, `flux2`, `chroma` or `zimage`.
        quick: every other component tiny too.
        text_encoders: `"full"` (the real encoder's shape) or `"small"` (its width, `SMALL_TEXT_LAYERS`
            layers); ignored with `quick`.
        seed: seeds every component's random weights.
        device, dtype: where and in what every other component's weights are made (`"meta"`: shapes only).
        prompt: the prompt the bench will send: the tokenizer learns its words (Qwen, Mistral).

    Example:
        >>> from tome_processors.bench.dit import build_transformer
        >>> built = build_image_pipeline(build_transformer("qwenimage", quick=True), "qwenimage", quick=True)
        >>> sorted(built.components), built.call_kwargs
        (['scheduler', 'text_encoder', 'tokenizer', 'transformer', 'vae'], {'negative_prompt': ' ', \
'true_cfg_scale': 4.0, 'guidance_scale': None})
    """
    if arch not in _ARCHITECTURES:
        raise ValueError(f"Expected arch among {list(IMAGE_PIPELINE_ARCHITECTURES)}, but got {arch!r}.")
    if text_encoders not in TEXT_ENCODER_SIZES:
        raise ValueError(f"Expected text_encoders among {list(TEXT_ENCODER_SIZES)}, but got {text_encoders!r}.")
    spec, size = _ARCHITECTURES[arch], "quick" if quick else text_encoders
    config = denoiser.config
    described = {"transformer": f"{type(denoiser).__name__}, the bench's {arch}{' (tiny)' if quick else ''} model"}
    torch.manual_seed(seed + 10)
    with constructed_on(device, dtype):
        vae = _vae(arch, quick, config.in_channels if arch == "zimage" else config.in_channels // 4)
    with torch.device("cpu"):  # its tables live on the CPU whatever default device the caller set
        scheduler = FlowMatchEulerDiscreteScheduler(**spec.scheduler)
    extra = {"image_encoder": None, "feature_extractor": None} if arch == "chroma" else {}
    pipe = getattr(diffusers, spec.pipeline)(
        scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=denoiser, **extra
    )

    with tempfile.TemporaryDirectory(prefix="tome-bench-tokenizers-") as folder:
        if arch == "chroma":
            tokenizer = write_t5_tokenizer(Path(folder) / "t5")
        else:
            template = {"flux2": _MISTRAL_TEMPLATE, "zimage": _QWEN3_TEMPLATE}.get(arch)
            kind = "mistral" if arch == "flux2" else "qwen"
            tokenizer = write_bpe_tokenizer(folder, _corpus(arch, pipe, prompt), kind, template)
    width = config.cap_feat_dim if arch == "zimage" else config.joint_attention_dim  # what the transformer reads
    if arch == "flux2":  # FLUX.2 reads several hidden states side by side
        width //= len(_FLUX2_LAYERS[size])
    torch.manual_seed(seed + 1)
    with constructed_on(device, dtype):
        text_config = _text_encoder_config(arch, width, len(tokenizer), quick, size == "small")
        encoder = _ENCODER_CLASSES[arch](text_config).eval()
    pipe.register_modules(text_encoder=encoder, tokenizer=tokenizer)

    text = text_config.text_config if arch in ("qwenimage", "flux2") else text_config
    depth = text.num_layers if arch == "chroma" else text.num_hidden_layers
    text_width = text.d_model if arch == "chroma" else text.hidden_size
    if quick:
        shape = f"tiny ({depth} layers, width {text_width})"
    elif size == "small":
        shape = f"{spec.encoder_label} width, {depth} of its {spec.encoder_layers} layers"
    else:
        shape = f"{spec.encoder_label} shape ({depth} layers, width {text_width})"
    described["text_encoder"] = f"{type(encoder).__name__}, {shape}, random weights"
    described["tokenizer"] = f"{type(tokenizer).__name__}, a vocabulary written locally"
    if arch == "flux2":
        described["tokenizer"] += " (in place of PixtralProcessor: only its tokenizer runs for text to image)"
    channels = vae.config.z_dim if arch == "qwenimage" else vae.config.latent_channels
    described["vae"] = (
        f"{type(vae).__name__}, {'tiny' if quick else spec.vae_label + ' shape'} ({channels} latent channels)"
    )
    described["scheduler"] = f"FlowMatchEulerDiscreteScheduler, {spec.scheduler_label}"
    pipe.set_progress_bar_config(disable=True)

    call_kwargs: dict[str, Any] = {}
    if arch == "qwenimage":  # Qwen-Image's published call: true classifier-free guidance with an empty negative
        call_kwargs.update(negative_prompt=" ", true_cfg_scale=4.0, guidance_scale=None)
    if arch == "flux2" and size != "full":
        call_kwargs["text_encoder_out_layers"] = _FLUX2_LAYERS[size]
    if quick and arch in ("flux2", "chroma"):  # the padded prompts, short
        call_kwargs["max_sequence_length"] = QUICK_TEXT_TOKENS
    return RandomPipeline(pipe, described, call_kwargs)
