"""ToMe stacked with the accelerators users run beside it, through whole pipeline calls (docs/stacking.md).

- DeepCache (`deepcache` 0.1.1) on SD1.5- and SDXL-shaped pipelines, cache interval 3: ToMe merges on the full
  steps and in the shallow blocks DeepCache still runs on the others.
- cache-dit's DBCache (`cache-dit` 1.5.3) on FLUX.1 and Qwen-Image: ToMe merges in the blocks it still runs.
- torchao int8 and optimum-quanto qint8 quantized UNets: ToMe merges as on the plain model.

Each pair is applied in both orders; every generation runs twice from one seed and must repeat bit for bit; taking
either one off leaves exactly the other's output (bit-equal to that one alone), and taking both off the plain
pipeline's. The real packages run (they come with the `test` extra); nothing is stubbed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import tome_processors as tp

from leftovers import tome_attributes_left
from pipelines import family_pipeline, tiny_sd_pipeline
from test_new_families import tiny_qwenimage_pipeline
from test_pipeline import sdxl_pipeline


@pytest.fixture(scope="module", autouse=True)
def one_thread_for_the_module() -> Iterator[None]:
    """One torch thread from the module's fixtures on: the images they make are compared bit for bit with the
    tests' (another thread count sums in another order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: DeepCache's cache interval in every test here: a full UNet forward on steps 0, 3, 6, ...
INTERVAL = 3
STEPS = 6


# ---------------------------------------------------------------- what ran, and with how many tokens


@dataclass
class Calls:
    """Per denoiser call (one per step, or per branch with true CFG), the query tokens of each self-attention run."""

    steps: list[dict[str, int]] = field(default_factory=list)


@contextmanager
def counting(denoiser: torch.nn.Module, attention: Callable[[str], bool]) -> Iterator[Calls]:
    """Record, per denoiser call, the tokens each selected attention's query projection got (after any merge)."""
    calls = Calls()
    handles = [denoiser.register_forward_pre_hook(lambda *_: calls.steps.append({}))]
    for name, module in denoiser.named_modules():
        if attention(name) and hasattr(module, "to_q"):
            hook = _recorder(calls, name)
            handles.append(module.to_q.register_forward_pre_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _recorder(calls: Calls, name: str) -> Callable[..., None]:
    def record(_: torch.nn.Module, args: tuple) -> None:
        calls.steps[-1][name] = int(args[0].shape[1])

    return record


def generate(pipe: Any, args: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return torch.from_numpy(pipe(**args, generator=torch.Generator().manual_seed(0)).images)


def twice(pipe: Any, args: dict[str, Any]) -> torch.Tensor:
    """One generation, run twice from one seed: the two must be bit-equal."""
    first = generate(pipe, args)
    assert torch.equal(first, generate(pipe, args)), "the same seed gave another image"
    return first


def change(image: torch.Tensor, reference: torch.Tensor) -> float:
    return float((image - reference).norm() / reference.norm())


@dataclass
class Pair:
    """Two accelerators on one pipeline: each put on and taken off by name."""

    on: dict[str, Callable[[], None]]
    off: dict[str, Callable[[], None]]


def check_pair(
    pair: Pair, order: tuple[str, str], pipe: Any, args: dict[str, Any], alone: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Apply the two in `order`, generate (twice), then take off either one and check the other is exact.

    `alone` holds the plain pipeline's image (`"none"`) and each accelerator's alone. Returns the pair's image.
    """
    first, second = order
    pair.on[first]()
    pair.on[second]()
    both = twice(pipe, args)
    for name, image in alone.items():
        assert change(both, image) > 1e-4, f"{first} then {second} gives the image of {name}"
    pair.off[first]()  # the one applied first comes off from under the other
    assert torch.equal(generate(pipe, args), alone[second]), f"{second} is not exact once {first} is off"
    pair.on[first]()
    assert torch.equal(generate(pipe, args), both), f"{first} put back on does not give the pair's image again"
    pair.off[second]()
    assert torch.equal(generate(pipe, args), alone[first]), f"{first} is not exact once {second} is off"
    pair.off[first]()
    assert torch.equal(generate(pipe, args), alone["none"]), "the pipeline is not exact once both are off"
    return both


ORDERS = [("tome", "other"), ("other", "tome")]
ORDER_IDS = ["tome-first", "other-first"]


# ---------------------------------------------------------------- DeepCache


def deepcache_helper(pipe: Any, branch: int) -> Any:
    deepcache = pytest.importorskip("DeepCache", reason="DeepCache is in the test extra: pip install -e '.[test]'")
    helper = deepcache.DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=INTERVAL, cache_branch_id=branch)
    return helper


@dataclass
class DeepCacheCase:
    name: str
    build: Callable[[Path], Any]
    branch: int  # DeepCache's cache_branch_id: which skip branch it keeps computing on partial steps
    merged: str  # a self-attention ToMe merges (the model's first attention level)
    partial: frozenset[str]  # the self-attentions that still run on partial steps


DEEPCACHE_CASES = {
    # SD1.5: level 1's last up-block attention runs on every step; ToMe merges there.
    "sd15": DeepCacheCase(
        "sd15", tiny_sd_pipeline, 0, "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
        frozenset({"up_blocks.2.attentions.1.transformer_blocks.0.attn1"}),
    ),
    # SDXL with the branch users take on SD1.5 (0): its first level has no attention, so the partial steps run none.
    "sdxl-branch0": DeepCacheCase(
        "sdxl", sdxl_pipeline, 0, "down_blocks.1.attentions.0.transformer_blocks.0.attn1", frozenset()
    ),
    # SDXL with a skip branch at its first attention level (3: up-block 1's last layer runs on partial steps).
    "sdxl-branch3": DeepCacheCase(
        "sdxl", sdxl_pipeline, 3, "down_blocks.1.attentions.0.transformer_blocks.0.attn1",
        frozenset(f"up_blocks.1.attentions.1.transformer_blocks.{i}.attn1" for i in range(2)),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def deepcache_runs(tmp_path_factory) -> dict[str, tuple[Any, dict[str, Any], dict[str, torch.Tensor]]]:
    """Per case: the pipeline, its call and the images of none, ToMe alone and DeepCache alone (built once)."""
    runs = {}
    for key, case in DEEPCACHE_CASES.items():
        pipe = case.build(tmp_path_factory.mktemp(key))
        args = dict(prompt="a cat", height=32, width=32, output_type="np", num_inference_steps=STEPS)
        alone = {"none": twice(pipe, args)}
        tp.apply_tome(pipe, ratio=0.5)
        alone["tome"] = twice(pipe, args)
        tp.remove_tome(pipe)
        helper = deepcache_helper(pipe, case.branch)
        helper.enable()
        alone["other"] = twice(pipe, args)
        helper.disable()
        runs[key] = (pipe, args, alone)
    return runs


@pytest.mark.parametrize("order", ORDERS, ids=ORDER_IDS)
@pytest.mark.parametrize("key", sorted(DEEPCACHE_CASES))
def test_deepcache_and_tome_in_either_order(key, order, deepcache_runs):
    case = DEEPCACHE_CASES[key]
    pipe, args, alone = deepcache_runs[key]
    helper = deepcache_helper(pipe, case.branch)
    pair = Pair(
        on={"tome": lambda: tp.apply_tome(pipe, ratio=0.5), "other": helper.enable},
        off={"tome": lambda: tp.remove_tome(pipe), "other": helper.disable},
    )
    pair.on[order[0]]()
    pair.on[order[1]]()
    with counting(pipe.unet, lambda name: name.endswith("attn1")) as calls:
        generate(pipe, args)
    pair.off[order[1]]()
    pair.off[order[0]]()
    # The attention's tokens at this size: 32 px through the tiny VAE (2x) gives a 16 x 16 latent.
    full = 16 * 16 if case.name == "sd15" else 8 * 8
    assert len(calls.steps) == STEPS
    for step, seen in enumerate(calls.steps):
        if step % INTERVAL == 0:  # a full step: every level runs, ToMe merges at its level (half the tokens)
            assert seen[case.merged] == full // 2, (step, seen)
        else:  # a partial step: only the shallow branch runs (if it has attention), and ToMe merges there too
            assert set(seen) == case.partial, (step, seen)
            assert all(tokens == full // 2 for tokens in seen.values()), (step, seen)
    check_pair(pair, order, pipe, args, alone)
    assert not tome_attributes_left(pipe.unet)


# ---------------------------------------------------------------- cache-dit's DBCache


def dbcache_on(pipe: Any) -> None:
    """cache-dit's DBCache on `pipe`: the first block computed on every step, the rest reused once warmed up (1 step),
    with a threshold no random-weight residual reaches, so every later step is a cached one."""
    cache_dit = pytest.importorskip("cache_dit", reason="cache-dit is in the test extra: pip install -e '.[test]'")
    # A new config each time: cache-dit fills in its fields for the pipeline it is given (enable_separate_cfg).
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=100.0, max_warmup_steps=1
    )
    cache_dit.enable_cache(pipe, cache_config=config)


def dbcache_off(pipe: Any) -> None:
    import cache_dit

    cache_dit.disable_cache(pipe)


def _flux(folder: Path) -> tuple[Any, dict[str, Any]]:
    return family_pipeline("flux", folder)  # 64 px


def _qwenimage(folder: Path) -> tuple[Any, dict[str, Any]]:
    pipe, args = tiny_qwenimage_pipeline(folder)
    return pipe, {**args, "height": 32, "width": 32, "output_type": "np"}


#: Per model: its tiny pipeline, the blocks computed on a cached step, and its image tokens (4 x 4 patches).
CACHE_DIT_CASES = {
    "flux": (_flux, {"transformer_blocks.0.attn"}, 16),
    "qwenimage": (_qwenimage, {"transformer_blocks.0.attn"}, 16),
}
CACHE_DIT_STEPS = 3


@pytest.fixture(scope="module")
def cache_dit_runs(tmp_path_factory) -> dict[str, tuple[Any, dict[str, Any], dict[str, torch.Tensor], dict[str, int]]]:
    """Per model: the pipeline, its call, the images of none, ToMe alone and DBCache alone, and the query tokens
    of each attention unmerged (FLUX.1's single blocks hold the text tokens too)."""
    runs = {}
    for key, (build, _, _) in CACHE_DIT_CASES.items():
        pipe, args = build(tmp_path_factory.mktemp(key))
        args = {**args, "num_inference_steps": CACHE_DIT_STEPS}
        with counting(pipe.transformer, lambda name: name.endswith(".attn")) as calls:
            alone = {"none": twice(pipe, args)}
        tp.apply_tome(pipe, ratio=0.5)
        alone["tome"] = twice(pipe, args)
        tp.remove_tome(pipe)
        dbcache_on(pipe)
        alone["other"] = twice(pipe, args)
        dbcache_off(pipe)
        runs[key] = (pipe, args, alone, calls.steps[0])
    return runs


@pytest.mark.parametrize("order", ORDERS, ids=ORDER_IDS)
@pytest.mark.parametrize("key", sorted(CACHE_DIT_CASES))
def test_cache_dit_dbcache_and_tome_in_either_order(key, order, cache_dit_runs):
    _, computed, image_tokens = CACHE_DIT_CASES[key]
    pipe, args, alone, unmerged = cache_dit_runs[key]
    pair = Pair(
        on={"tome": lambda: tp.apply_tome(pipe, ratio=0.5), "other": lambda: dbcache_on(pipe)},
        off={"tome": lambda: tp.remove_tome(pipe), "other": lambda: dbcache_off(pipe)},
    )
    pair.on[order[0]]()
    pair.on[order[1]]()
    with counting(pipe.transformer, lambda name: name.endswith(".attn")) as calls:
        generate(pipe, args)
    pair.off[order[1]]()
    pair.off[order[0]]()
    every_block = {name for name, module in pipe.transformer.named_modules() if name.endswith(".attn")}
    assert len(every_block) > len(computed)
    calls_per_step = len(calls.steps) // CACHE_DIT_STEPS  # Qwen-Image's true CFG: one call per branch
    for call, seen in enumerate(calls.steps):
        # The warm-up step runs every block; the cached ones only the first: ToMe merges in each block that runs.
        assert set(seen) == (every_block if call < calls_per_step else computed), (call, seen)
        assert all(unmerged[site] - tokens == image_tokens // 2 for site, tokens in seen.items()), (call, seen)
    check_pair(pair, order, pipe, args, alone)
    assert not tome_attributes_left(pipe.transformer)


# ---------------------------------------------------------------- quantized UNets (torchao, optimum-quanto)


def torchao_int8_weight_only(unet: torch.nn.Module) -> None:
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is in the test extra")
    quantization.quantize_(unet, quantization.Int8WeightOnlyConfig())


def torchao_int8_dynamic(unet: torch.nn.Module) -> None:
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is in the test extra")
    quantization.quantize_(unet, quantization.Int8DynamicActivationInt8WeightConfig())


def quanto_qint8(unet: torch.nn.Module) -> None:
    quanto = pytest.importorskip("optimum.quanto", reason="optimum-quanto is in the test extra")
    quanto.quantize(unet, weights=quanto.qint8)
    quanto.freeze(unet)


QUANTIZERS = {
    "torchao-int8-weight-only": torchao_int8_weight_only,
    "quanto-qint8": quanto_qint8,
    "torchao-int8-dynamic": torchao_int8_dynamic,
}
QUANTIZED_ARGS = dict(prompt="a cat", height=32, width=32, output_type="np", num_inference_steps=2)
MERGED = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"


@pytest.fixture(scope="module")
def quantized_alone(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Each quantizer's image alone, on a fresh tiny SD pipeline (their weights are seeded: every build is equal)."""
    images = {}
    for name, quantize in QUANTIZERS.items():
        pipe = tiny_sd_pipeline(tmp_path_factory.mktemp(name))
        quantize(pipe.unet)
        images[name] = twice(pipe, QUANTIZED_ARGS)
    return images


@pytest.mark.parametrize("tome_first", [False, True], ids=["quantized-first", "tome-first"])
@pytest.mark.parametrize("name", sorted(QUANTIZERS))  # torchao's dynamic int8: slow (tests/conftest.py)
def test_tome_merges_on_a_quantized_unet(name, tome_first, quantized_alone, tmp_path):
    pipe = tiny_sd_pipeline(tmp_path)
    plain_linear = type(pipe.unet.get_submodule(MERGED).to_q.weight)
    if tome_first:
        tp.apply_tome(pipe, ratio=0.5)
        QUANTIZERS[name](pipe.unet)
    else:
        QUANTIZERS[name](pipe.unet)
        tp.apply_tome(pipe, ratio=0.5)
    assert type(pipe.unet.get_submodule(MERGED).to_q.weight) is not plain_linear  # the weights are quantized
    with counting(pipe.unet, lambda site: site == MERGED) as calls:
        merged = twice(pipe, QUANTIZED_ARGS)
    assert [seen[MERGED] for seen in calls.steps] == [16 * 16 // 2] * 4  # two steps, twice: half the tokens
    assert torch.isfinite(merged).all()
    assert change(merged, quantized_alone[name]) > 1e-4  # ToMe changes the quantized model's image
    tp.remove_tome(pipe)
    assert torch.equal(generate(pipe, QUANTIZED_ARGS), quantized_alone[name])  # and leaves it exact when off
    assert not tome_attributes_left(pipe.unet)
