"""Every image and video transformer diffusers ships is either merged by a family or refused with its reason.

A diffusers release that adds a model fails `test_every_class_is_merged_or_refused_with_its_reason` until someone
declares a family for it or a reason to refuse it; docs/families.md carries the table as `coverage_table()` prints
it. Each class a family merges has a case in the family table (tests/family_cases/) or in the tests of the families
that came before it, which run the model and its pipeline.
"""

from __future__ import annotations

import re
from pathlib import Path

from tome_processors.families import FAMILIES, REFUSED
from tome_processors.families.coverage import NOT_IMAGE_OR_VIDEO, coverage, coverage_table

from family_cases import CASES

DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
#: The families whose models are tested in files of their own (test_dit.py, test_video.py, test_new_families.py,
#: test_ltx*.py, test_hunyuanvideo.py, test_wan_derivatives.py), from before the family table.
TESTED_ELSEWHERE = {
    "pixart", "sd3", "flux", "flux2", "chroma", "qwenimage", "zimage", "wan", "skyreels_v2", "wan_vace", "ltx", "ltx2",
    "hunyuanvideo", "hunyuanvideo15",
}  # fmt: skip


def test_every_class_is_merged_or_refused_with_its_reason():
    rows = coverage()
    undecided = [row.name for row in rows if row.undecided]
    assert not undecided, f"diffusers classes with neither a family nor a reason to refuse them: {undecided}"
    for row in rows:
        if row.reason is not None:  # a reason of its own, naming the class
            assert row.name in row.reason and "ToMe cannot" in row.reason, row


def test_the_count_diffusers_ships_and_how_many_merge():
    rows = coverage()
    assert len(rows) == 64  # diffusers 0.42.1's image and video transformers (NOT_IMAGE_OR_VIDEO left out)
    assert sum(row.family is not None for row in rows) >= 28


def test_every_merged_class_is_run_by_a_test():
    tabled = {case.family for case in CASES.values()}
    for row in coverage():
        if row.family is not None:
            assert row.family in tabled or row.family in TESTED_ELSEWHERE, f"{row.name} ({row.family}) runs in no test"


def test_refusals_and_families_do_not_overlap():
    for cls in REFUSED:
        assert all(
            family.model_class is None or not issubclass(cls, family.model_class) for family in FAMILIES.values()
        )
    assert not set(NOT_IMAGE_OR_VIDEO) & {row.name for row in coverage()}


def test_the_docs_carry_the_table():
    page = DOC.read_text()
    table = re.search(r"<!-- coverage -->\n(.*?)\n<!-- /coverage -->", page, re.S)
    assert table is not None and table.group(1).strip() == coverage_table(), (
        "docs/families.md's coverage table is not coverage_table()'s: paste `python -c 'from "
        "tome_processors.families.coverage import coverage_table; print(coverage_table())'` between its markers"
    )
