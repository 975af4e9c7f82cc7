"""Every example in the package's docstrings runs and prints what it shows (those marked `+SKIP` need weights,
a pipeline or a GPU)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import types

import pytest

import tome_processors

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(tome_processors.__path__, "tome_processors.")
    if info.name != "tome_processors.__main__"  # running it is running the command
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, one_thread):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed"


def test_the_examples_are_found():
    # The check above must see the examples: a module with a runnable one is among them.
    assert "tome_processors.bench.engine" in MODULES
    finder = doctest.DocTestFinder()
    examples = sum(len(t.examples) for t in finder.find(importlib.import_module("tome_processors.bench.engine")))
    assert examples >= 2
    wrong = types.ModuleType("wrong", "Example:\n    >>> 1 + 1\n    3\n")
    assert doctest.testmod(wrong, report=False, verbose=False).failed == 1
