"""The docs speak to users: every link between the README and docs/ lands on a page and a heading that exist, and
neither they nor the package's comments and strings speak of how the work on the library was organised (issues,
targets of our own, sessions). Text only: no model is built, the whole file runs in well under a second."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted((ROOT / "src" / "tome_processors").rglob("*.py"))

#: Words that speak of the project's organisation, not of the library. `target` as a word of its own only: names
#: such as `target_models`, `target_size`, `within_target` or `_Target` do not match.
FORBIDDEN = {
    "an issue of ours": re.compile(r"\bissue", re.IGNORECASE),
    "a target of ours": re.compile(r"(?<![-\w])targets?\b", re.IGNORECASE),
    "a session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "a lent machine": re.compile(r"\blent\b", re.IGNORECASE),
}
#: Legitimate uses, removed from a line before it is searched: the `target %` column that `tome-processors quality
#: --presets` prints (the bound each preset is held to), copied into docs/options.md as printed.
ALLOWED = (re.compile(r"\| target % \|"), re.compile(r'"target %"'))


def _strip_allowed(line: str) -> str:
    for pattern in ALLOWED:
        line = pattern.sub("", line)
    return line


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """Every line of a markdown page, numbered from 1."""
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))


def _source_text_lines(path: Path) -> list[tuple[int, str]]:
    """The comments and string literals (docstrings included) of a Python file, line by line: the code's own
    names (a variable called `target`) are not prose."""
    found: list[tuple[int, str]] = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    for token in tokens:
        text = token.string
        if token.type == tokenize.STRING and re.fullmatch(r"""[rbRB]?(['"])\w+\1""", text):
            continue  # a key or a name in quotes (`row["target"]`), not prose
        if token.type == tokenize.STRING and re.match(r"[rbRB]?[fF]", text):
            text = re.sub(r"\{[^{}]*\}", "", text)  # an f-string's fields are code
        if token.type in (tokenize.COMMENT, tokenize.STRING) or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for offset, line in enumerate(text.splitlines()):
                found.append((token.start[0] + offset, line))
    return found


def _hits(lines: list[tuple[int, str]]) -> list[str]:
    hits = []
    for number, line in lines:
        text = _strip_allowed(line)
        hits += [f"{number}: {what}: {line.strip()}" for what, pattern in FORBIDDEN.items() if pattern.search(text)]
    return hits


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_speak_of_the_library_not_of_its_making(path):
    hits = _hits(_prose_lines(path))
    assert not hits, f"Expected no issue, target, session or lent in {path.name}, but got:\n" + "\n".join(hits)


def test_package_comments_and_strings_speak_of_the_library_not_of_its_making():
    hits = [f"{path.relative_to(ROOT)}:{hit}" for path in SOURCES for hit in _hits(_source_text_lines(path))]
    assert not hits, "Expected no issue, target, session or lent in src/, but got:\n" + "\n".join(hits)


def test_source_scan_reads_comments_and_docstrings_not_names_or_keys(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        '''"""Meets the issue's target."""\n'''
        "target = row['target']  # for the session\n"
        """label = f"{target} | x"\n""",
        encoding="utf-8",
    )
    hits = _hits(_source_text_lines(source))
    assert [hit.split(":")[0] for hit in hits] == ["1", "1", "2"], hits


def test_the_forbidden_words_are_found_and_the_legitimate_names_are_not():
    assert _hits([(1, "Issue 22's Wan targets are met.")]) and _hits([(1, "the older issues' GPU targets")])
    assert _hits([(1, "the target (`balanced` 1.5x)")]) and _hits([(1, "as a session lent it")])
    legitimate = "target_models(pipe), target_size 640, row['within_target'], _Target, TARGET_FACTOR"
    assert not _hits([(1, legitimate), (2, "| family | preset | eps change % | target % |")])


# Links between the pages: [text](page.md#anchor), [text](#anchor), relative to the page that holds them.
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not hyphens, underscores), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for _, line in _prose_lines(path):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    links, in_code = [], False
    for number, line in _prose_lines(path):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            links += [(number, target) for target in LINK.findall(line)]
    return links


def test_slug_follows_github():
    assert _slug(" torch.compile") == "torchcompile"
    assert _slug("Video, batch 1, bf16 (`window`, `newvideo`)") == "video-batch-1-bf16-window-newvideo"
    assert _slug("How it stays on through diffusers' swaps") == "how-it-stays-on-through-diffusers-swaps"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_land_on_a_page_and_heading_that_exist(path):
    broken = []
    for number, link in _links(path):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        page, _, anchor = link.partition("#")
        target = (path.parent / page).resolve() if page else path
        if not target.exists():
            broken.append(f"{number}: {link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{number}: {link} (no heading with that anchor in {target.name})")
    assert not broken, f"Expected every link of {path.name} to resolve, but got:\n" + "\n".join(broken)
