"""A batch of merged Flux attention in one call: a rotary table per sample (`batched_rotary`).

Each sample's merged rows are kept at their own token positions. Processors known to rotate through diffusers'
`apply_rotary_emb` get `SampleTables` and run the batch at once; any other processor runs one sample at a time.
Both must give what one call per sample gives.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import (
    Attention,
    CogVideoXAttnProcessor2_0,
    FusedCogVideoXAttnProcessor2_0,
    HunyuanAttnProcessor2_0,
    MochiAttention,
    MochiAttnProcessor2_0,
)
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_bria import BriaAttention, BriaAttnProcessor
from diffusers.models.transformers.transformer_bria_fibo import BriaFiboAttention, BriaFiboAttnProcessor
from diffusers.models.transformers.transformer_cogview4 import CogView4AttnProcessor
from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxIPAdapterAttnProcessor,
)
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
)
from diffusers.models.transformers.transformer_flux3 import Flux3Attention, Flux3AttnProcessor
from diffusers.models.transformers.transformer_glm_image import GlmImageAttnProcessor
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageAttnProcessor
from diffusers.models.transformers.transformer_joyimage import JoyImageAttention, JoyImageAttnProcessor
from diffusers.models.transformers.transformer_krea2 import Krea2Attention, Krea2AttnProcessor
from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttention, LongCatImageAttnProcessor
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Attention, MiniMaxH3AttnProcessor
from diffusers.models.transformers.transformer_motif_video import MotifVideoAttention, MotifVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoEAttnProcessor2_0
from diffusers.models.transformers.transformer_omnigen import OmniGenAttnProcessor2_0
from diffusers.models.transformers.transformer_ovis_image import OvisImageAttention, OvisImageAttnProcessor
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0, apply_rotary_emb_qwen
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Attention,
    QwenImage21AttnProcessor,
    QwenImage21FlexAttnProcessor,
)

import tome_processors as tp
from tome_processors.batched_rotary import (
    BROADCAST_TABLE_PROCESSORS,
    SAMPLE_TABLE_PROCESSORS,
    SampleTables,
    sample_tables,
    takes_broadcast_tables,
    takes_sample_tables,
)

from family_cases.video_more import mochi_inputs, tiny_mochi
from test_dit import flux_inputs, run, tiny_flux
from test_new_families import qwenimage_inputs, tiny_qwenimage

DIM, HEADS, HEAD_DIM, TEXT, ROWS, IP_DIM = 32, 2, 16, 5, 11, 24


def per_sample_tables(batch: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)` of `(batch, rows, HEAD_DIM)`: a different rotation for every sample and row."""
    angle = torch.rand(batch, rows, HEAD_DIM // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    return angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)


def per_sample_complex(batch: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Qwen-Image's kind of table: `(batch, rows, HEAD_DIM // 2)` complex rotations, each sample's and row's own."""
    angle = torch.rand(batch, rows, HEAD_DIM // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    return torch.polar(torch.ones_like(angle), angle)


def test_sample_tables_rotate_each_sample_as_its_own_complex_table_does():
    table = per_sample_complex(3, ROWS)
    x = torch.randn(3, ROWS, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    batched = apply_rotary_emb_qwen(x, SampleTables(table), use_real=False)
    alone = [apply_rotary_emb_qwen(x[b : b + 1], table[b], use_real=False) for b in range(3)]
    assert torch.equal(batched, torch.cat(alone))
    assert not torch.equal(alone[0], apply_rotary_emb_qwen(x[:1], table[1], use_real=False))


@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_sample_tables_rotate_each_sample_as_its_own_table_does(sequence_dim):
    cos, sin = per_sample_tables(3, ROWS)
    shape = (3, ROWS, HEADS, HEAD_DIM) if sequence_dim == 1 else (3, HEADS, ROWS, HEAD_DIM)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    batched = apply_rotary_emb(x, (SampleTables(cos), SampleTables(sin)), sequence_dim=sequence_dim)
    alone = [apply_rotary_emb(x[b : b + 1], (cos[b], sin[b]), sequence_dim=sequence_dim) for b in range(3)]
    assert torch.equal(batched, torch.cat(alone))  # the same products, element by element
    assert not torch.equal(alone[0], apply_rotary_emb(x[:1], (cos[1], sin[1]), sequence_dim=sequence_dim))


def test_sample_tables_refuse_views_they_do_not_know_and_wrong_shapes():
    tables = SampleTables(torch.zeros(2, ROWS, HEAD_DIM))
    with pytest.raises(TypeError, match=r"Expected the view \[None, :, None, :\]"):
        tables[:3]
    with pytest.raises(TypeError, match=r"Expected the view unsqueeze\(1\) .* but got unsqueeze\(0\)"):
        tables.unsqueeze(0)
    with pytest.raises(ValueError, match=r"Expected a rotary table per sample of shape \(B, S, D\), but got \(5, 4\)"):
        SampleTables(torch.zeros(5, 4))


def test_sample_tables_gather_each_samples_rows():
    cos, sin = torch.randn(9, HEAD_DIM), torch.randn(9, HEAD_DIM)
    row_token = torch.tensor([[0, 1, 4, 7], [0, 1, 8, 2]])
    got = sample_tables((cos, sin), row_token)
    assert isinstance(got, tuple) and all(isinstance(t, SampleTables) for t in got)
    for b in range(2):
        assert torch.equal(got[0].table[b], cos[row_token[b]]) and torch.equal(got[1].table[b], sin[row_token[b]])
    assert isinstance(sample_tables([cos, sin], row_token), list)
    # Qwen-Image's (image, text): the image's complex table follows the rows, the text's passes as it is.
    image, text = torch.randn(9, HEAD_DIM // 2, dtype=torch.complex64), torch.randn(3, HEAD_DIM // 2)
    got = sample_tables((image, text), row_token, follow=1)
    assert isinstance(got[0], SampleTables) and got[1] is text
    assert all(torch.equal(got[0].table[b], image[row_token[b]]) for b in range(2))


def _flux_joint() -> tuple[torch.nn.Module, object, dict]:
    attn = FluxAttention(DIM, HEADS, HEAD_DIM, added_kv_proj_dim=DIM, bias=True, context_pre_only=False)
    return attn, FluxAttnProcessor(), {"text": True}


def _flux_single() -> tuple[torch.nn.Module, object, dict]:
    attn = FluxAttention(DIM, HEADS, HEAD_DIM, bias=True, pre_only=True)
    return attn, FluxAttnProcessor(), {"text": False}


def _flux_ip_adapter() -> tuple[torch.nn.Module, object, dict]:
    attn = FluxAttention(DIM, HEADS, HEAD_DIM, added_kv_proj_dim=DIM, bias=True, context_pre_only=False)
    return attn, FluxIPAdapterAttnProcessor(DIM, IP_DIM, num_tokens=(4,)), {"text": True, "ip": True}


def _flux2_joint() -> tuple[torch.nn.Module, object, dict]:
    return Flux2Attention(DIM, HEADS, HEAD_DIM, added_kv_proj_dim=DIM), Flux2AttnProcessor(), {"text": True}


def _flux2_parallel() -> tuple[torch.nn.Module, object, dict]:
    return Flux2ParallelSelfAttention(DIM, HEADS, HEAD_DIM), Flux2ParallelSelfAttnProcessor(), {"text": False}


def _hunyuanvideo(single: bool, processor: type = HunyuanVideoAttnProcessor2_0) -> tuple[torch.nn.Module, object, dict]:
    """HunyuanVideo's double-stream (added K/V) or single-stream attention; its tables cover the image alone.
    HunyuanImage 2.1's blocks build the same attention modules (with `HunyuanImageAttnProcessor`)."""
    joint = {} if single else {"added_kv_proj_dim": DIM, "context_pre_only": False}
    attn = Attention(DIM, dim_head=HEAD_DIM, heads=HEADS, out_dim=DIM, bias=True, qk_norm="rms_norm", eps=1e-6,
                     pre_only=single, **joint)  # fmt: skip
    extra = {"mask": True} if processor is HunyuanVideo15AttnProcessor2_0 else {}  # 1.5's needs the text's mask
    return attn, processor(), {"text": True, "image_only_rotary": True, **extra}


def _cog(processor: type) -> tuple[torch.nn.Module, object, dict]:
    """The CogVideoX lineage's joint attention (text then image in one sequence), its tables over the image alone
    (its projections fused with `FusedCogVideoXAttnProcessor2_0`); CogView 4's with its mask over the text."""
    attn = Attention(DIM, dim_head=HEAD_DIM, heads=HEADS, out_dim=DIM, bias=True, qk_norm="layer_norm", eps=1e-6)
    if processor is FusedCogVideoXAttnProcessor2_0:
        attn.fuse_projections()
    extra = {"mask": True} if processor is CogView4AttnProcessor else {}
    return attn, processor(), {"text": True, "image_only_rotary": True, **extra}


def _qwenimage() -> tuple[torch.nn.Module, object, dict]:
    """Qwen-Image's joint attention: its complex image table over the image alone, a text table of its own."""
    attn = Attention(DIM, added_kv_proj_dim=DIM, dim_head=HEAD_DIM, heads=HEADS, out_dim=DIM, context_pre_only=False,
                     bias=True, qk_norm="rms_norm", eps=1e-6)  # fmt: skip
    return attn, QwenDoubleStreamAttnProcessor2_0(), {"text": True, "qwen": True}


def _flux3() -> tuple[torch.nn.Module, object, dict]:
    return Flux3Attention(DIM, HEADS, HEAD_DIM), Flux3AttnProcessor(), {"text": False}


def _krea2() -> tuple[torch.nn.Module, object, dict]:
    """Krea 2's attention: grouped-query (one key/value head for two query heads) and a sigmoid output gate."""
    return Krea2Attention(DIM, HEADS, num_kv_heads=1), Krea2AttnProcessor(), {"text": False}


def _longcat(single: bool) -> tuple[torch.nn.Module, object, dict]:
    joint = {} if single else {"added_kv_proj_dim": DIM, "context_pre_only": False}
    attn = LongCatImageAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, out_dim=DIM, bias=True, pre_only=single, **joint)
    return attn, LongCatImageAttnProcessor(), {"text": not single}


def _qwenimage21(processor: type) -> tuple[torch.nn.Module, object, dict]:
    """Qwen-Image 2.1's single-stream attention (as in its cached steps: no block-causal mask), its complex table over
    the whole sequence."""
    return QwenImage21Attention(DIM, HEADS, HEAD_DIM), processor(), {"text": False, "qwen21": True}


def _cosmos() -> tuple[torch.nn.Module, object, dict]:
    """Cosmos's self-attention (`attn1`): the video tokens alone, rotated with tables over them."""
    attn = Attention(DIM, heads=HEADS, dim_head=HEAD_DIM, qk_norm="rms_norm", elementwise_affine=True, out_bias=False)
    return attn, CosmosAttnProcessor2_0(), {"text": False}


def _easyanimate() -> tuple[torch.nn.Module, object, dict]:
    """EasyAnimate's joint attention (text first, its own projections): its tables cover the video alone."""
    attn = Attention(DIM, dim_head=HEAD_DIM, heads=HEADS, qk_norm="layer_norm", eps=1e-6, bias=True,
                     added_proj_bias=True, added_kv_proj_dim=DIM, context_pre_only=False)  # fmt: skip
    return attn, EasyAnimateAttnProcessor2_0(), {"text": True, "image_only_rotary": True}


def _minimax_h3() -> tuple[torch.nn.Module, object, dict]:
    """MiniMax-H3's attention over its packed sequence: tables over every token, passed as `rotary_emb`."""
    return MiniMaxH3Attention(DIM, HEADS, HEAD_DIM), MiniMaxH3AttnProcessor(), {"text": False, "rotary": "rotary_emb"}


def _joyimage() -> tuple[torch.nn.Module, object, dict]:
    """JoyImage-Edit's joint attention: `((cos, sin), None)`, the image's pair over the image alone, no text table."""
    return JoyImageAttention(DIM, HEADS, HEAD_DIM), JoyImageAttnProcessor(), {"text": True, "nested": True}


def _motif_video(single: bool) -> tuple[torch.nn.Module, object, dict]:
    """Motif-Video's double-stream (added K/V) or single-stream attention; its tables cover the video alone."""
    joint = {} if single else {"added_kv_proj_dim": DIM}
    attn = MotifVideoAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, out_dim=DIM, bias=True, pre_only=single, **joint)
    return attn, MotifVideoAttnProcessor2_0(), {"text": True, "image_only_rotary": True}


def _omnigen() -> tuple[torch.nn.Module, object, dict]:
    """OmniGen's self-attention, called as cross-attention to its own tokens; its tables cover the whole sequence."""
    attn = Attention(DIM, cross_attention_dim=DIM, dim_head=HEAD_DIM, heads=HEADS, kv_heads=HEADS, bias=False,
                     out_dim=DIM, out_bias=False)  # fmt: skip
    return attn, OmniGenAttnProcessor2_0(), {"text": False, "own_keys": True}


def _hunyuandit(cross: bool) -> tuple[torch.nn.Module, object, dict]:
    """Hunyuan-DiT's self-attention (queries and keys rotated) or cross-attention to the text (the queries alone):
    `(cos, sin)` over the image tokens, applied with `sequence_dim=2`; one output, the image's."""
    attn = Attention(DIM, cross_attention_dim=DIM if cross else None, dim_head=HEAD_DIM, heads=HEADS,
                     qk_norm="layer_norm", eps=1e-6, bias=True)  # fmt: skip
    return attn, HunyuanAttnProcessor2_0(), {"text": cross, "image_only_rotary": True, "image_out": True}


def _flux_like(attention: type, processor: type, single: bool) -> tuple[torch.nn.Module, object, dict]:
    """Bria's, Bria Fibo's and Ovis-Image's attention: FLUX.1's, with a processor of their own."""
    joint = {} if single else {"added_kv_proj_dim": DIM, "context_pre_only": False}
    attn = attention(DIM, heads=HEADS, dim_head=HEAD_DIM, out_dim=DIM, bias=True, pre_only=single, **joint)
    return attn, processor(), {"text": not single}


def _glm_image() -> tuple[torch.nn.Module, object, dict]:
    """GLM-Image's attention: text then image in one sequence, the tables over the image alone, a mask over the
    text that the processor spreads over both."""
    attn = Attention(DIM, heads=HEADS, dim_head=HEAD_DIM, out_dim=DIM, bias=True, qk_norm="layer_norm",
                     elementwise_affine=False, eps=1e-5)  # fmt: skip
    return attn, GlmImageAttnProcessor(), {"text": True, "image_only_rotary": True, "mask": True}


def _nucleusmoe() -> tuple[torch.nn.Module, object, dict]:
    """Nucleus-MoE-Image's attention: image queries, image then text keys (two key/value heads), complex
    `(image, text)` tables; its mask spans the image (ones) then the text."""
    attn = Attention(DIM, heads=HEADS, kv_heads=1, dim_head=HEAD_DIM, added_kv_proj_dim=DIM, added_proj_bias=False,
                     out_dim=DIM, out_bias=False, bias=False, qk_norm="rms_norm", eps=1e-6)  # fmt: skip
    return (
        attn,
        NucleusMoEAttnProcessor2_0(),
        {"text": True, "qwen": True, "image_then_text_mask": True, "image_output_only": True},
    )


PROCESSORS = {
    "cosmos": _cosmos,
    "minimax-h3": _minimax_h3,
    "easyanimate": _easyanimate,
    "flux-joint": _flux_joint,
    "flux-single": _flux_single,
    "flux-ip-adapter": _flux_ip_adapter,
    "flux2-joint": _flux2_joint,
    "flux2-parallel": _flux2_parallel,
    "flux3": _flux3,
    "krea2": _krea2,
    "longcat-joint": lambda: _longcat(single=False),
    "longcat-single": lambda: _longcat(single=True),
    "hunyuanvideo-double": lambda: _hunyuanvideo(single=False),
    "hunyuanvideo-single": lambda: _hunyuanvideo(single=True),
    "hunyuanvideo15": lambda: _hunyuanvideo(single=False, processor=HunyuanVideo15AttnProcessor2_0),
    "hunyuanimage-double": lambda: _hunyuanvideo(single=False, processor=HunyuanImageAttnProcessor),
    "hunyuanimage-single": lambda: _hunyuanvideo(single=True, processor=HunyuanImageAttnProcessor),
    "hunyuandit-self": lambda: _hunyuandit(cross=False),
    "hunyuandit-cross": lambda: _hunyuandit(cross=True),
    "qwenimage": _qwenimage,
    "cogvideox": lambda: _cog(CogVideoXAttnProcessor2_0),
    "cogvideox-fused": lambda: _cog(FusedCogVideoXAttnProcessor2_0),
    "cogview4": lambda: _cog(CogView4AttnProcessor),
    "qwenimage21": lambda: _qwenimage21(QwenImage21AttnProcessor),
    "qwenimage21-flex": lambda: _qwenimage21(QwenImage21FlexAttnProcessor),
    "joyimage": _joyimage,
    "motif-video-double": lambda: _motif_video(single=False),
    "motif-video-single": lambda: _motif_video(single=True),
    "omnigen": _omnigen,
    "bria-joint": lambda: _flux_like(BriaAttention, BriaAttnProcessor, single=False),
    "bria-single": lambda: _flux_like(BriaAttention, BriaAttnProcessor, single=True),
    "bria-fibo-joint": lambda: _flux_like(BriaFiboAttention, BriaFiboAttnProcessor, single=False),
    "ovis-image-joint": lambda: _flux_like(OvisImageAttention, OvisImageAttnProcessor, single=False),
    "ovis-image-single": lambda: _flux_like(OvisImageAttention, OvisImageAttnProcessor, single=True),
    "glm-image": _glm_image,
    "nucleusmoe-image": _nucleusmoe,
}


def test_every_processor_given_sample_tables_is_checked_here():
    assert {type(make()[1]) for make in PROCESSORS.values()} == SAMPLE_TABLE_PROCESSORS


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_processors_given_sample_tables_match_one_call_per_sample(name, one_thread):
    torch.manual_seed(0)
    attn, processor, parts = PROCESSORS[name]()
    attn.eval()
    assert takes_sample_tables(processor)
    g = torch.Generator().manual_seed(2)
    batch = 2
    image = torch.randn(batch, ROWS, DIM, generator=g)
    text = torch.randn(batch, TEXT, DIM, generator=g) if parts["text"] else None
    if parts.get("qwen21"):  # one complex table over the sequence, per sample
        table = per_sample_complex(batch, ROWS)
        batched_rotary, alone_rotary = SampleTables(table), list(table)
    elif parts.get("qwen"):  # (image, text): the image's table per sample, the text's one for the batch
        table, text_table = per_sample_complex(batch, ROWS), per_sample_complex(1, TEXT, seed=3)[0]
        batched_rotary, alone_rotary = (SampleTables(table), text_table), [(t, text_table) for t in table]
    elif parts.get("nested"):  # ((cos, sin), None): the image's pair per sample, no text table
        cos, sin = per_sample_tables(batch, ROWS)
        batched_rotary = ((SampleTables(cos), SampleTables(sin)), None)
        alone_rotary = [((c, s), None) for c, s in zip(cos, sin, strict=True)]
    else:
        rotated = ROWS + (TEXT if parts["text"] and not parts.get("image_only_rotary") else 0)
        cos, sin = per_sample_tables(batch, rotated)
        batched_rotary, alone_rotary = (SampleTables(cos), SampleTables(sin)), list(zip(cos, sin, strict=True))
    kwargs = {"ip_hidden_states": [torch.randn(batch, 4, IP_DIM, generator=g)]} if parts.get("ip") else {}
    mask = torch.arange(TEXT).expand(batch, TEXT) < TEXT - 1  # over the text alone, its last token padding

    def call(b: slice | None, rotary: tuple) -> object:
        pick = (lambda x: x) if b is None else (lambda x: x[b])
        extra = {k: [pick(t) for t in v] for k, v in kwargs.items()}
        if parts.get("mask"):
            extra["attention_mask"] = pick(mask)
        if parts.get("image_then_text_mask"):
            extra["attention_mask"] = pick(torch.cat([torch.ones(batch, ROWS, dtype=torch.bool), mask], dim=1))
        elif parts.get("qwen"):
            extra["encoder_hidden_states_mask"] = pick(mask)
        if parts.get("qwen21"):
            return processor(attn, pick(image), rotary_emb=rotary, **extra)
        if parts.get("own_keys"):  # keys and values from the same tokens
            return processor(attn, pick(image), pick(image), image_rotary_emb=rotary, **extra)
        if parts["text"]:
            return processor(attn, pick(image), pick(text), image_rotary_emb=rotary, **extra)
        return processor(attn, pick(image), **{parts.get("rotary", "image_rotary_emb"): rotary}, **extra)

    with torch.no_grad():
        batched = call(None, batched_rotary)
        alone = [call(slice(b, b + 1), alone_rotary[b]) for b in range(batch)]
    batched = batched if isinstance(batched, tuple) else (batched,)
    alone = [out if isinstance(out, tuple) else (out,) for out in alone]
    one_output = parts.get("image_out") or parts.get("image_output_only")  # the image's output alone
    outputs = 3 if parts.get("ip") else 2 if parts["text"] and not one_output else 1
    assert len(batched) == len(alone[0]) == outputs
    for got, *parts_alone in zip(batched, *alone, strict=True):
        torch.testing.assert_close(got, torch.cat(parts_alone), rtol=1e-6, atol=1e-6)


class OwnFlux(FluxAttnProcessor):
    """A subclass of Flux's processor: it could read its rotary table any way, so it gets one per sample."""


class OwnRotary:
    """A user's own processor that rotates with diffusers' `apply_rotary_emb`; records the tables it got."""

    def __init__(self) -> None:
        self.inner = FluxAttnProcessor()
        self.seen: list[tuple[int, object]] = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        self.seen.append((hidden_states.shape[0], image_rotary_emb))
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


OPTIONS = [
    pytest.param({}, id="default"),
    pytest.param({"use_rand": False, "ratio": 0.5}, id="fixed"),
    pytest.param({"share_level": True}, id="share_level"),
]


def run_recording(
    model: torch.nn.Module, inputs: dict, processor_class: type, rotary_position: int, options: dict
) -> tuple[torch.Tensor, list[tuple[int, object]]]:
    """`model`'s output with ToMe at `options` (removed after) and, for each call of `processor_class`, its batch
    size and the rotary tables it got (`image_rotary_emb`, or the argument at `rotary_position`)."""
    calls = []
    original = processor_class.__call__

    def recording(self, attn, hidden_states, *args, **kwargs):
        rotary = args[rotary_position] if len(args) > rotary_position else kwargs.get("image_rotary_emb")
        calls.append((hidden_states.shape[0], rotary))
        return original(self, attn, hidden_states, *args, **kwargs)

    tp.apply_tome(model, **options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processor_class, "__call__", recording)
        out = run(model, inputs)
    tp.remove_tome(model)
    return out, calls


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_flux_batch_in_one_call_matches_one_sample_at_a_time(batch, options, one_thread):
    model, inputs = tiny_flux(2, 2), flux_inputs(batch=batch)
    batched, calls = run_recording(model, inputs, FluxAttnProcessor, 2, options)
    assert len(calls) == 4 and all(size == batch for size, _ in calls)  # one call per block, the whole batch
    assert all(isinstance(table, SampleTables) for _, rotary in calls for table in rotary)

    model.set_attn_processor(OwnFlux())
    tp.apply_tome(model, **options)
    alone = run(model, inputs)  # one sample at a time
    if batch == 1:
        assert torch.equal(batched, alone)  # the same ops on the same values
    else:
        torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    tp.remove_tome(model)
    assert not torch.equal(run(model, inputs), alone)  # ToMe changed the output: the comparison means something


def test_a_users_own_rotary_processor_runs_one_sample_at_a_time_and_agrees(one_thread):
    model, inputs = tiny_flux(2, 2), flux_inputs(batch=2)
    tp.apply_tome(model, ratio=0.5)
    batched = run(model, inputs)
    tp.remove_tome(model)
    own = OwnRotary()
    model.set_attn_processor(own)
    tp.apply_tome(model, ratio=0.5)
    torch.testing.assert_close(run(model, inputs), batched, rtol=1e-5, atol=1e-5)
    assert len(own.seen) == 2 * 4  # each of the four blocks once per sample
    for size, (cos, sin) in own.seen:  # plain tables, one sample's
        assert size == 1 and type(cos) is torch.Tensor and cos.ndim == 2 and sin.shape == cos.shape


def _ip_adapter_processors(model: torch.nn.Module, cls: type, state: dict | None = None) -> dict:
    """Flux's IP-Adapter processor (`cls`) on the double-stream blocks, Flux's own on the single-stream ones."""
    processors = {}
    for name in model.attn_processors:
        if name.startswith("transformer_blocks."):
            torch.manual_seed(3)
            processor = cls(model.inner_dim, IP_DIM, num_tokens=(4,), scale=0.7)
            if state is not None:
                processor.load_state_dict(state)
            processors[name] = processor
        else:
            processors[name] = FluxAttnProcessor()
    return processors


def test_flux_ip_adapter_batch_in_one_call_matches_one_sample_at_a_time(one_thread):
    class OwnIPAdapter(FluxIPAdapterAttnProcessor):
        pass

    model, inputs = tiny_flux(2, 2), flux_inputs(batch=2)
    ip = torch.randn(2, 4, IP_DIM, generator=torch.Generator().manual_seed(4))
    inputs["joint_attention_kwargs"] = {"ip_hidden_states": [ip]}
    processors = _ip_adapter_processors(model, FluxIPAdapterAttnProcessor)
    state = next(iter(processors.values())).state_dict()
    model.set_attn_processor(processors)
    tp.apply_tome(model, ratio=0.5)
    batched = run(model, inputs)
    without_ip = run(model, {**inputs, "joint_attention_kwargs": {"ip_hidden_states": [torch.zeros_like(ip)]}})
    tp.remove_tome(model)
    model.set_attn_processor(_ip_adapter_processors(model, OwnIPAdapter, state))
    tp.apply_tome(model, ratio=0.5)
    alone = run(model, inputs)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(batched, without_ip, atol=1e-4)  # the image prompt reached the output


class OwnQwen(QwenDoubleStreamAttnProcessor2_0):
    """A subclass of Qwen-Image's processor: it runs one sample at a time."""


@pytest.mark.parametrize("reference", [None, (4, 4)], ids=["qwenimage", "qwenimage-edit"])
@pytest.mark.parametrize("options", OPTIONS)
def test_qwenimage_batch_in_one_call_matches_one_sample_at_a_time(options, reference, one_thread):
    model, inputs = tiny_qwenimage(3), qwenimage_inputs(batch=2, reference=reference)
    batched, calls = run_recording(model, inputs, QwenDoubleStreamAttnProcessor2_0, 3, options)
    assert len(calls) == 3 and all(size == 2 for size, _ in calls)  # one call per block, the whole batch
    assert all(isinstance(image, SampleTables) and type(text) is torch.Tensor for _, (image, text) in calls)

    model.set_attn_processor(OwnQwen())
    tp.apply_tome(model, **options)
    alone = run(model, inputs)  # one sample at a time
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    tp.remove_tome(model)
    assert not torch.allclose(run(model, inputs), alone, atol=1e-4)  # ToMe changed the output


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("options", [{}, {"recompute_every": 2}, {"share_level": True, "recompute_every": 3}])
def test_qwenimage_text_table_follows_each_calls_text(batch, options, one_thread):
    # True classifier-free guidance calls the model with two prompts of different lengths in turn; merges kept
    # across calls must not keep the other prompt's text table.
    model = tiny_qwenimage(2)
    seen = []
    original = QwenDoubleStreamAttnProcessor2_0.__call__

    def recording(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                  attention_mask=None, image_rotary_emb=None):  # fmt: skip
        seen.append((encoder_hidden_states.shape[1], image_rotary_emb[1].shape[0]))
        return original(self, attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                        image_rotary_emb)  # fmt: skip

    tp.apply_tome(model, **options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QwenDoubleStreamAttnProcessor2_0, "__call__", recording)
        for text in (7, 3, 7, 3):
            inputs = qwenimage_inputs(batch=batch)
            inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, :text]
            inputs["encoder_hidden_states_mask"] = inputs["encoder_hidden_states_mask"][:, :text]
            run(model, inputs)
    assert [text for text, _ in seen] == [7, 7, 3, 3, 7, 7, 3, 3]
    assert all(text == table for text, table in seen)


# ---------------------------------------------------------------- tables that broadcast as they are (Mochi)


def test_sample_tables_gather_rows_of_tables_of_any_rank_as_plain_tensors():
    cos, sin = torch.randn(9, HEADS, HEAD_DIM // 2), torch.randn(9, HEADS, HEAD_DIM // 2)
    row_token = torch.tensor([[0, 1, 4, 7], [0, 1, 8, 2]])
    got = sample_tables((cos, sin), row_token, broadcast=True)
    assert isinstance(got, tuple)
    assert all(type(t) is torch.Tensor and t.shape == (2, 4, HEADS, HEAD_DIM // 2) for t in got)
    for b in range(2):
        assert torch.equal(got[0][b], cos[row_token[b]]) and torch.equal(got[1][b], sin[row_token[b]])


def test_every_processor_given_broadcast_tables_is_checked_here():
    assert BROADCAST_TABLE_PROCESSORS == {MochiAttnProcessor2_0}
    assert takes_broadcast_tables(MochiAttnProcessor2_0()) and not takes_sample_tables(MochiAttnProcessor2_0())


class OwnMochi(MochiAttnProcessor2_0):
    """A subclass of Mochi's processor: it could read its tables any way, so it is run one sample at a time."""


def test_mochi_processor_given_broadcast_tables_matches_one_call_per_sample(one_thread):
    torch.manual_seed(0)
    attn = MochiAttention(DIM, DIM, MochiAttnProcessor2_0(), heads=HEADS, dim_head=HEAD_DIM, out_dim=DIM).eval()
    g = torch.Generator().manual_seed(2)
    image, text = torch.randn(2, ROWS, DIM, generator=g), torch.randn(2, TEXT, DIM, generator=g)
    angle = torch.rand(2, ROWS, HEADS, HEAD_DIM // 2, generator=g) * 6.3  # each sample's, row's and head's own
    mask = torch.arange(TEXT).expand(2, TEXT) < TEXT - 1  # over the text alone, its last token padding
    with torch.no_grad():
        batched = attn.processor(attn, image, text, mask, (angle.cos(), angle.sin()))
        alone = [
            attn.processor(attn, image[b : b + 1], text[b : b + 1], mask[b : b + 1], (angle[b].cos(), angle[b].sin()))
            for b in range(2)
        ]
    for got, *parts in zip(batched, *alone, strict=True):
        torch.testing.assert_close(got, torch.cat(parts), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("options", OPTIONS)
def test_mochi_batch_in_one_call_matches_one_sample_at_a_time(options, one_thread):
    model, inputs = tiny_mochi(), mochi_inputs()
    batched, calls = run_recording(model, inputs, MochiAttnProcessor2_0, 3, options)
    assert len(calls) == 2 and all(size == 2 for size, _ in calls)  # one call per block, the whole batch
    assert all(type(t) is torch.Tensor and t.shape[0] == 2 and t.ndim == 4 for _, rotary in calls for t in rotary)
    for block in model.transformer_blocks:
        block.attn1.processor = OwnMochi()
    tp.apply_tome(model, **options)
    with torch.no_grad():
        alone = model(**inputs).sample  # one sample at a time
    tp.remove_tome(model)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.equal(model(**inputs).sample, alone)  # ToMe changed the output: the comparison means something
