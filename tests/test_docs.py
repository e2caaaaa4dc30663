"""The notes stay short and their links lead somewhere (no JAX: plain text checks).

Every relative link in README.md and docs/*.md must name a file of the
repository, and a `#anchor` must name a heading of that page (GitHub's
slugs); no page sends a reader outside the repository's own folders
(`../shared/`); README.md and BUILD_NOTES.md keep to their lengths
(a front page and a card file, not a history).
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
BUILD_NOTES_MAX_LINES = 600

# [text](target) and ![alt](target); the target ends at the first space or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
  """The page without its fenced code blocks and inline code (links there are not links)."""
  lines, inside = [], False
  for line in text.splitlines():
    if _FENCE.match(line.strip()):
      inside = not inside
      continue
    if not inside:
      lines.append(re.sub(r"`[^`]*`", "", line))
  return "\n".join(lines)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"`", "", heading.strip().lower())
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
  seen: dict[str, int] = {}
  anchors = set()
  for line in _prose(page.read_text()).splitlines():
    match = re.match(r"^#{1,6}\s+(.*)$", line)
    if not match:
      continue
    slug = _slug(match.group(1))
    n = seen.get(slug, 0)
    anchors.add(slug if n == 0 else f"{slug}-{n}")
    seen[slug] = n + 1
  return anchors


def _relative_links(page: pathlib.Path) -> list[str]:
  return [t for t in _LINK.findall(_prose(page.read_text()))
          if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours to check


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_and_heading_that_exist(page):
  broken = []
  for target in _relative_links(page):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists() or ROOT not in (dest, *dest.parents):
      broken.append(f"{target} (no such file in the repository)")
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
      broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
  assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


@pytest.mark.parametrize("page", [*PAGES, ROOT / "BUILD_NOTES.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_sends_a_reader_outside_the_repository(page):
  assert "../shared/" not in page.read_text(), (
      f"{page.relative_to(ROOT)} mentions ../shared/, which a clone of the repository does not have")


def test_the_front_page_and_the_card_file_stay_short():
  readme = len((ROOT / "README.md").read_text().splitlines())
  notes = len((ROOT / "BUILD_NOTES.md").read_text().splitlines())
  assert readme <= README_MAX_LINES, (
      f"README.md has {readme} lines, over {README_MAX_LINES}: move a topic to a docs/ page and link it")
  assert notes <= BUILD_NOTES_MAX_LINES, (
      f"BUILD_NOTES.md has {notes} lines, over {BUILD_NOTES_MAX_LINES}: drop superseded passes "
      "(git keeps them) and keep each benchmark's current figure with its command")


def test_the_slugs_follow_githubs_rules():
  # The anchors the pages use rest on these; a wrong slug would pass broken links.
  assert _slug("Invariants (every test and every change keeps these)") == (
      "invariants-every-test-and-every-change-keeps-these")
  assert _slug('What "fast" means here') == "what-fast-means-here"
  assert _slug("Modes: sync, hybrid or elastic") == "modes-sync-hybrid-or-elastic"
  assert _slug("The `hetjax train` flags") == "the-hetjax-train-flags"
