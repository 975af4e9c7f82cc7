"""Shared pytest fixtures, and which tests the README's quick command leaves to the heavy run.

The README's `python -m pytest -q` runs every public behaviour on every family at least once, on two worker
processes (pytest-xdist, `addopts` in pyproject.toml), in minutes. The tests marked `slow` repeat a path that a
quick test already takes (another call order, another family of the same code path, the same check on the
trained video model, full-size configurations); they run with `python -m pytest -q -m slow` (`.ci/run` runs both).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

#: Tests that repeat a path a quick test already covers: node-id regular expressions, each with the quick tests
#: that cover it. Kept here, not in the test files, so one list says what the quick run leaves out.
SLOW_REPEATS: dict[str, str] = {
    # The same compile check (one graph, eager parity at every size) as on unet, flux and wan.
    r"tests/test_copy_compile_fuse.py::test_compiled_tome_equals_eager_tome_at_every_size_with_no_eager_call_first"
    r"\[(?!unet\]|flux\]|wan\]).*\]": "[unet], [flux], [wan]",
    # The second call order of each video composition, kept quick on Wan 2.1.
    r"tests/test_video_compositions.py::test_\w+_and_tome\[(?!wan-(?!i2v))[^\]]*-tome-last\]": "[wan-...-tome-last]",
    # The trained video model's probe: test_denoises_better_than_trivial_predictors[video] and test_video.py's trained
    # video columns stay quick; the same checks run quick on the image shapes.
    r"tests/test_trained_shapes.py::test_(report_lists_every_reference_method|measuring_leaves_the_model_unmerged_and"
    r"_options_agree|changes_grow_with_the_merge_ratio|tome_changes_it_less_than_dropping_attention)\[video\]": (
        "the same test on [unet], [dit], [flux]"
    ),
    r"tests/test_trained_shapes.py::test_video_presets_quality_on_the_video_model\[.*\]": (
        "test_presets.py's quality on the trained UNet and DiT"
    ),
    # Random destinations at batch 1: the same rule (`guidance_in_batch`) on the other families of the code path.
    r"tests/test_odd_batch.py::test_batch_one_pipelines_choose_random_destinations"
    r"\[(?!qwenimage\]|wan\]|flux2-edit\]).*\]": "[qwenimage], [wan], [flux2-edit]",
    # Reuse counted per branch: Qwen-Image (two calls a step) and FLUX.2 with a reference image stay quick.
    r"tests/test_reuse_across_steps.py::test_reuse_counts_denoising_steps_not_model_calls"
    r"\[(?!qwenimage\]|flux2-edit\]).*\]": "[qwenimage], [flux2-edit]",
    # diffusers' caches failing on a pipeline without ToMe: diffusers' own path; with ToMe stays quick.
    r"tests/test_cache_pipelines.py::test_caches_fail_on_these_pipelines_with_or_without_tome\[\w+-False\]": (
        "[flux2-True], [chroma-True]"
    ),
    # A feed-forward chunked by two samples: as by one.
    r"tests/test_chunked_feed_forward.py::test_merge_mlp_merges_a_feed_forward_chunked_over_the_batch\[2\]": "[1]",
    # torchao's dynamic int8 quantization under ToMe: the same path as its weight-only int8 (a tensor subclass).
    r"tests/test_stacking.py::test_tome_merges_on_a_quantized_unet\[torchao-int8-dynamic-.*\]": (
        "[torchao-int8-weight-only-...]"
    ),
    # Bench rows at the real width: PixArt's stays quick.
    r"tests/test_dit.py::test_bench_rows_for_transformer_architectures\[(?!pixart\]).*\]": "[pixart]",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    patterns = [re.compile(pattern) for pattern in SLOW_REPEATS]
    for item in items:
        if any(pattern.fullmatch(item.nodeid) for pattern in patterns):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    # Each xdist worker is one process on a 2-core machine: one torch thread each, or they stall (tests that need
    # two threads set them).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block on `count` torch threads, then restore the earlier count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Run a test on one torch thread: tiny models on a shared 2-core machine stall when oversubscribed (10x here)."""
    with torch_threads(1):
        yield


@pytest.fixture
def two_threads():
    """Run a test on two torch threads, where a promise depends on threads (same output run after run)."""
    with torch_threads(2):
        yield


@pytest.fixture(scope="session", autouse=True)
def merge_where_selected():
    """Presets merge only where merging pays (`pays_only`, pays.py), and on tiny test models it never does: the
    session runs with the rule's table set to merge wherever a config selects (before any module's fixtures build
    and run their models), so the tests of what presets merge keep testing it."""
    from tome_processors.pays import ALWAYS, pays_table

    with pays_table(ALWAYS):
        yield


@pytest.fixture(autouse=True)
def real_pays_rule(request):
    """Tests of the rule itself (`@pytest.mark.pays_rule`, and the pays module's docstring examples) run with the
    real table."""
    if request.node.get_closest_marker("pays_rule") is None and "tome_processors.pays]" not in request.node.name:
        yield
        return
    from tome_processors.pays import THRESHOLDS, pays_table

    with pays_table(THRESHOLDS):
        yield
