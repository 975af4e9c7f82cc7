"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run a test on one torch thread: tiny models on a shared 2-core machine stall when oversubscribed (10x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def merge_where_selected(request):
    """Presets merge only where merging pays (`pays_only`, pays.py), and on tiny test models it never does: every
    test runs with the rule's table set to merge wherever a config selects, so the tests of what presets merge keep
    testing it. Tests of the rule itself are marked `@pytest.mark.pays_rule` and run with the real table."""
    # The rule's own docstring examples show its real verdicts.
    if request.node.get_closest_marker("pays_rule") is not None or "tome_processors.pays]" in request.node.name:
        yield
        return
    from tome_processors.pays import ALWAYS, pays_table

    with pays_table(ALWAYS):
        yield
