"""`pays_only`: presets merge only where the measured figures say it pays, decided from shapes and the device type.

The rule runs with its real thresholds here (`pays_rule` marker; tests/conftest.py lets every other test merge
wherever a config selects). The CUDA verdicts are checked without a GPU: they come from shapes and a device type.
"""

from __future__ import annotations

import logging

import pytest
import torch

import tome_processors as tp
from tome_processors import SiteExplanation, ToMeConfig, explain_tome
from tome_processors.bench.hostcost import count_aten_ops
from tome_processors.bench.unet import ARCHITECTURES
from tome_processors.hooks import context_of
from tome_processors.pays import ALWAYS, THRESHOLDS, PaysThresholds, judge, pays_table, predicted_speedup

from models import tiny_unet

pytestmark = pytest.mark.pays_rule

SD15, SDXL = (320, 640, 1280), (640, 1280)  # widths of the levels with attention (SDXL's start at level 2)


def unet_inputs(batch: int = 2, side: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "sample": torch.randn(batch, 4, side, side, generator=g),
        "timestep": torch.tensor(500),
        "encoder_hidden_states": torch.randn(batch, 7, 32, generator=g),
    }


def meta_unet(arch: str) -> torch.nn.Module:
    """A full-size UNet of `arch` without weights (shapes are all the rule reads)."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel(**ARCHITECTURES[arch])


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


# (preset, px, level, width, depth) -> the CUDA verdict's factor: 0 merges nothing, else the K/V window side (1 for
# merging). The sizes of the H100/H200 figures the thresholds come from (pays.py).
CUDA_UNET_CASES = [
    ("balanced", "SD1.5 512", 64 * 64, 320, 2),  # N/C 12.8: 1.02x measured
    ("fast", "SD1.5 512", 64 * 64, 320, 2),  # 4x4 only pays more from N/C 50: 2x2
    ("fast", "SD1.5 512 level 2", 32 * 32, 640, 0),
    ("balanced", "SDXL 1024", 64 * 64, 640, 0),  # N/C 6.4: 0.98x measured
    ("fast", "SDXL 1024 level 4", 32 * 32, 1280, 0),
    ("balanced", "SD1.5 1024", 128 * 128, 320, 2),
    ("fast", "SD1.5 1024", 128 * 128, 320, 4),  # N/C 51.2: 4x4 1.17x against 2x2 1.16x
    ("fast", "SD1.5 1024 level 2", 64 * 64, 640, 0),
    ("fast", "SD1.5 2048", 256 * 256, 320, 4),
    ("fast", "SD1.5 2048 level 2", 128 * 128, 640, 2),
    ("balanced", "SDXL 2048", 128 * 128, 640, 2),  # 1.10x measured
    ("fast", "SDXL 2048", 128 * 128, 640, 2),  # 4x4 there: 1.00x against 2x2's 1.04x-1.10x
    ("fast", "SDXL 2048 level 4", 64 * 64, 1280, 0),  # fast's second level there: 0.98x in all
    ("exact", "SD1.5 512", 64 * 64, 320, 0),  # 0.84x
    ("exact", "SD1.5 1024", 128 * 128, 320, 0),  # 0.95x
    ("exact", "SDXL 2048", 128 * 128, 640, 0),  # 0.95x
    ("exact", "SD1.5 2048", 256 * 256, 320, 1),  # 1.52x
]


@pytest.mark.parametrize(("preset", "what", "tokens", "width", "factor"), CUDA_UNET_CASES)
def test_cuda_verdicts_on_the_unets_follow_the_measured_figures(preset, what, tokens, width, factor):
    config = ToMeConfig.from_preset(preset, "unet")
    verdict = judge(config, "unet", tokens=tokens, width=width, depth=2, device_type="cuda")
    assert verdict.factor == factor, (what, verdict)
    assert verdict.why


@pytest.mark.parametrize(
    ("family", "preset", "tokens", "width", "depth", "merges"),
    [
        ("pixart", "balanced", 4096, 1152, 28, False),  # 0.96x at 1024 px
        ("pixart", "exact", 4096, 1152, 28, False),  # 0.71x
        ("qwenimage", "balanced", 4096, 3072, 4, False),  # 4 blocks: 1.07x and 0.94x in two runs
        ("qwenimage", "balanced", 4096, 3072, 60, True),  # full depth: 1.29x per step
        ("flux2", "fast", 4096, 6144, 4, True),  # 1.60x at 2 + 2 blocks
        ("qwenimage", "exact", 4096, 3072, 60, False),  # 0.96x
        ("wan", "exact", 21 * 30 * 52, 1536, 30, True),  # 1.78x
    ],
)
def test_cuda_verdicts_on_the_transformers(family, preset, tokens, width, depth, merges):
    config = ToMeConfig.from_preset(preset, family)
    assert (judge(config, "transformer", tokens, width, depth, "cuda").factor > 0) is merges


def test_cpu_verdicts_tiny_models_merge_nothing_real_widths_merge():
    for preset in ("exact", "balanced", "fast"):
        config = ToMeConfig.from_preset(preset, "unet")
        assert judge(config, "unet", 16 * 16, 32, 3, "cpu").factor == 0  # the --quick UNet at 128 px
        assert judge(config, "unet", 64 * 64, 320, 5, "cpu").factor > 0  # SD1.5 at 512 px: 1.14x-1.23x
        assert judge(config, "unet", 32 * 32, 320, 5, "cpu").factor > 0  # SD1.5 at 256 px: 1.03x-1.08x
        pixart = ToMeConfig.from_preset(preset, "pixart")
        assert judge(pixart, "transformer", 8 * 8, 32, 2, "cpu").factor == 0
        assert judge(pixart, "transformer", 32 * 32, 1152, 28, "cpu").factor > 0


def test_the_rule_judges_kv_pooling_with_the_levels_own_window():
    fast = ToMeConfig.from_preset("fast", "unet")  # 4x4 at level 1, 2x2 at level 2
    assert judge(fast, "unet", 128 * 128, 320, 2, "cpu", level=1).factor == 4  # SD1.5 1024 px
    assert judge(fast, "unet", 64 * 64, 640, 2, "cpu", level=2).factor == 2
    assert judge(fast.replace(level_kv_factors=None), "unet", 64 * 64, 640, 2, "cpu", level=2).factor == 4


def test_unknown_device_types_take_the_gpus_thresholds():
    config = ToMeConfig.from_preset("balanced", "unet")
    for tokens in (64 * 64, 128 * 128):
        verdicts = [judge(config, "unet", tokens, 640, 2, device) for device in ("mps", "cuda")]
        assert verdicts[0].factor == verdicts[1].factor


def test_a_table_the_tests_can_set():
    config = ToMeConfig.from_preset("fast", "unet")
    assert judge(config, "unet", 16, 32, 1, "cpu").factor == 0
    with pays_table(ALWAYS):
        assert judge(config, "unet", 16, 32, 1, "cpu").factor == 4
    with pays_table({("cpu", "unet"): PaysThresholds(0.0, 1e9, 0.0, 0.0, 0.0)}):
        assert judge(config, "unet", 16, 32, 1, "cpu").factor == 2
        with pytest.raises(KeyError, match="Expected thresholds for \\('cuda', 'unet'\\)"):
            judge(config, "unet", 16, 32, 1, "cuda")  # a table without a CUDA row
    assert judge(config, "unet", 16, 32, 1, "cpu").factor == 0  # restored


def test_presets_on_a_tiny_unet_on_the_cpu_merge_nothing_and_say_so_once(caplog):
    unet = tiny_unet("sd15").eval()
    inputs = unet_inputs()
    baseline = forward(unet, inputs)
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(unet, preset=preset)
        with caplog.at_level(logging.INFO, logger="tome_processors"):
            caplog.clear()
            outputs = [forward(unet, inputs) for _ in range(3)]
        assert all(torch.equal(out, baseline) for out in outputs), preset
        lines = [r for r in caplog.records if "pays_only" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO, preset
        assert "merges nothing" in lines[0].getMessage() and "on cpu" in lines[0].getMessage()
        tp.remove_tome(unet)


def test_explicit_options_still_merge_as_tomesd():
    unet = tiny_unet("sd15").eval()
    inputs = unet_inputs()
    baseline = forward(unet, inputs)
    tp.apply_tome(unet, ratio=0.5)  # pays_only=False: merges wherever selected, tomesd's behaviour
    assert not torch.equal(forward(unet, inputs), baseline)
    tp.apply_tome(unet, preset="fast", pays_only=False)  # a preset, forced to merge everywhere
    assert not torch.equal(forward(unet, inputs), baseline)
    tp.remove_tome(unet)


def test_the_rule_narrows_kv_pooling_where_the_table_says():
    # 4x4 does not pay more than 2x2 here (table): `fast` pools 2x2, as `fast` with kv_factor=2 forced everywhere.
    unet = tiny_unet("sd15").eval()
    inputs = unet_inputs()
    narrowing = PaysThresholds(kv_load=0.0, kv4_load=1e9, block_work=0.0, shared_block_work=0.0, shared_level_work=0.0)
    with pays_table(narrowing):
        tp.apply_tome(unet, preset="fast")
        narrowed = forward(unet, inputs)
        tp.apply_tome(unet, preset="fast", kv_factor=2, pays_only=False)
        assert torch.equal(narrowed, forward(unet, inputs))
        tp.apply_tome(unet, preset="fast", pays_only=False)
        assert not torch.equal(narrowed, forward(unet, inputs))
    tp.remove_tome(unet)


def test_decided_once_per_grid_and_device_type_with_no_extra_op():
    unet = tiny_unet("sd15").eval()
    inputs = unet_inputs()
    _, baseline_ops, _ = count_aten_ops(lambda: forward(unet, inputs))
    tp.apply_tome(unet, preset="balanced")
    context = context_of(unet)
    forward(unet, inputs)
    decided = context.decisions
    _, ops, syncs = count_aten_ops(lambda: forward(unet, inputs))
    assert context.decisions is decided and len(decided) == 1  # the second forward decided nothing again
    assert ops == baseline_ops and not syncs  # merging nothing costs no aten op and no sync
    forward(unet, unet_inputs(side=8))  # another grid: one more decision
    assert len(context.decisions) == 2
    # The decision for a CUDA device type, without a GPU: from shapes alone.
    assert context.paying((16, 16), 1, "cuda") == (0,) * 7
    tp.remove_tome(unet)


#: Merging pays from a work per block of 1e6: at level 1 of the 16 x 16 latent (2.4e6), nowhere on the 8 x 8 one.
MERGING_PAYS_FROM_1E6 = {
    ("cpu", "unet"): PaysThresholds(
        kv_load=0.0, kv4_load=0.0, block_work=1e6, shared_block_work=1e6, shared_level_work=0.0
    )
}


def test_a_grid_where_nothing_pays_passes_through_and_lets_the_last_merges_go():
    unet = tiny_unet("sd15").eval()
    big, small = unet_inputs(side=16), unet_inputs(side=8)
    plain_big, plain_small = forward(unet, big), forward(unet, small)
    with pays_table(MERGING_PAYS_FROM_1E6):
        tp.apply_tome(unet, preset="exact", recompute_every=2)  # keeps its merges across steps: state to let go
        context = context_of(unet)
        state = context.model_state
        merged_big = [forward(unet, big) for _ in range(2)]
        assert any(state.paying) and state.kept and not torch.equal(merged_big[0], plain_big)
        for _ in range(2):
            assert torch.equal(forward(unet, small), plain_small)
            assert not any(state.paying) and state.latent_hw == (8, 8)
            assert not state.kept and state._plans == () and state.timestep is None
            assert all(block.metric is None and block.merge is None for block in context.blocks)
        assert torch.equal(forward(unet, big), merged_big[0])  # merging again where it pays, from a new matching
    tp.remove_tome(unet)


def test_a_block_attached_while_running_holds_nothing_once_merging_stops_paying():
    # `set_attn_processor` attaches in the first forward, inside a running block whose post-hook never runs.
    unet = tiny_unet("sd15").eval()
    with pays_table(MERGING_PAYS_FROM_1E6):
        unet.set_attn_processor(tp.ToMeProcessor(config=ToMeConfig.from_preset("exact", "unet")))
        forward(unet, unet_inputs(side=16))  # merges at level 1
        context = context_of(unet)
        assert context.blocks[0].merge is not None  # the block that was running when ToMe attached
        forward(unet, unet_inputs(side=8))  # merges nowhere
        assert all(block.metric is None and block.merge is None for block in context.blocks)
    tp.remove_tome(unet)


def test_a_preset_still_says_when_the_grid_has_no_whole_window():
    unet = tiny_unet("sd15").eval()
    tp.apply_tome(unet, preset="exact", sx=4, sy=4)
    with pytest.warns(UserWarning, match="its 2x2 token grid has no whole 4x4"):
        forward(unet, unet_inputs(side=2))
    tp.remove_tome(unet)


def test_the_hook_decides_as_explain_tome_says():
    unet = tiny_unet("sd15").eval()
    table = {
        ("cpu", "unet"): PaysThresholds(
            kv_load=7.0, kv4_load=0.0, block_work=0.0, shared_block_work=0.0, shared_level_work=0.0
        )
    }
    with pays_table(table):
        tp.apply_tome(unet, preset="fast")  # two levels: N/C 8 at level 1 (16 x 16 tokens, width 32), 1.3 at level 2
        forward(unet, unet_inputs(side=16))
        paying = context_of(unet).model_state.paying
        rows = explain_tome(unet, 128, 128, batch=2, print_table=False)
    tp.remove_tome(unet)
    assert sorted(paying) == [0, 0, 0, 0, 4, 4, 4]  # 3 blocks at level 1, 3 at level 2, the mid block (not selected)
    assert [(row.level, row.tokens, row.merges, row.kv_factor) for row in rows] == [
        (1, 256, True, 4),
        (2, 64, False, None),
        (4, 16, False, None),
    ]


def test_explain_tome_prints_and_returns_rows_per_site(capsys):
    unet = meta_unet("sd15")
    rows = explain_tome(unet, height=2048, width=2048, batch=2, device_type="cuda", preset="fast")
    printed = capsys.readouterr().out
    assert all(isinstance(row, SiteExplanation) for row in rows)
    assert [(row.level, row.tokens, row.merges, row.kv_factor) for row in rows] == [
        (1, 65536, True, 4),
        (2, 16384, True, 2),
        (4, 4096, False, None),
        (8, 1024, False, None),
    ]
    assert rows[0].predicted_speedup == 2.35 and "2048" in rows[0].measured  # the H100's SD1.5 2048 px figure
    assert rows[2].why.startswith("not selected")
    assert "| UNet2DConditionModel | fast | 1 | 320 | 5 | 65536 x 2 | yes (4x4 K/V) |" in printed
    # Every preset where none is given or applied.
    every = explain_tome(unet, 1024, 1024, device_type="cpu", print_table=False)
    assert {row.setting for row in every} == {"exact", "balanced", "fast"}
    assert all(row.merges for row in every if row.level == 1)  # on the CPU all pay at 1024 px (exact 1.55x)
    sdxl = explain_tome(meta_unet("sdxl"), 1024, 1024, device_type="cuda", print_table=False)
    assert not any(row.merges for row in sdxl)  # SDXL at 1024 on a GPU: no preset pays (0.90x-0.98x measured)


def test_explain_tome_on_a_pipeline_and_an_applied_config(tmp_path):
    from pipelines import tiny_sd_pipeline

    pipe = tiny_sd_pipeline(tmp_path)
    tp.apply_tome(pipe, ratio=0.5)
    rows = explain_tome(pipe, 128, 128, print_table=False)
    assert {row.setting for row in rows} == {"config"}
    assert any(row.merges and row.why.startswith("pays_only=False") for row in rows)
    tp.remove_tome(pipe)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"height": 0, "width": 64}, ValueError, "height to be a positive int"),
        ({"height": 64, "width": 64.0}, ValueError, "width to be a positive int"),
        ({"height": 64, "width": 64, "batch": 0}, ValueError, "batch to be a positive int"),
        ({"height": 64, "width": 64, "preset": "turbo"}, ValueError, "preset to be one of"),
        ({"height": 64, "width": 64, "preset": "fast", "config": ToMeConfig()}, ValueError, "not both"),
        ({"height": 64, "width": 64, "device_type": 3}, TypeError, "device_type"),
    ],
)
def test_explain_tome_rejects_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        explain_tome(tiny_unet("sd15"), **kwargs)


def test_predictions_interpolate_the_measured_figures():
    assert predicted_speedup("cuda", "unet", "kv2", 204.8)[0] == 1.74
    low, high = predicted_speedup("cuda", "unet", "kv2", 12.8)[0], predicted_speedup("cuda", "unet", "kv2", 25.6)[0]
    assert low < predicted_speedup("cuda", "unet", "kv2", 18.0)[0] < high
    assert predicted_speedup("cuda", "unet", "kv2", 1e6)[0] == 1.74  # beyond the figures: the nearest
    assert set(THRESHOLDS) >= {("cuda", "unet"), ("cuda", "transformer"), ("cpu", "unet"), ("cpu", "transformer")}


@pytest.mark.parametrize("family", ["pixart", "flux", "qwenimage", "zimage", "wan"])
def test_presets_on_tiny_transformers_on_the_cpu_do_the_baselines_work(family, one_thread):
    from test_presets import forward as family_forward
    from test_presets import model_and_inputs

    model, inputs = model_and_inputs(family)
    family_forward(model, inputs)  # fills the models' own caches (Qwen-Image's rotary tables)
    baseline, baseline_ops, baseline_syncs = count_aten_ops(lambda: family_forward(model, inputs))
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(model, preset=preset)
        family_forward(model, inputs)  # decides
        out, ops, syncs = count_aten_ops(lambda: family_forward(model, inputs))
        assert torch.equal(out, baseline) and ops == baseline_ops, (preset, ops - baseline_ops, baseline_ops - ops)
        assert syncs == baseline_syncs  # Qwen-Image's own forward has one
        tp.remove_tome(model)
