"""The README and the manual in docs/: links that resolve, and a settings table that matches the
settings class, so the documents cannot drift from the code without a test saying so."""

from __future__ import annotations

import re
from pathlib import Path

from megaslide.server.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path: Path) -> set[str]:
    """The fragment ids GitHub gives a page's headings (lowercase, punctuation dropped, spaces to
    hyphens); headings inside code blocks are not headings."""
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#+ (.*)", line)):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def prose(path: Path) -> str:
    """A page without its code blocks and inline code, where `a[i](x)` is code, not a link."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_links_between_the_documents_resolve():
    broken = []
    for doc in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
            if target.startswith(("http://", "https://")):
                continue
            path, _, fragment = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_settings_table_lists_every_setting():
    """docs/serving.md's table names each field of `Settings` as its environment variable, and
    nothing else."""
    text = (ROOT / "docs" / "serving.md").read_text()
    documented = set(re.findall(r"^\| `(MEGASLIDE_[A-Z0-9_]+)` \|", text, re.M))
    fields = {f"MEGASLIDE_{name.upper()}" for name in Settings.model_fields}
    assert documented == fields, {
        "undocumented": sorted(fields - documented),
        "no such setting": sorted(documented - fields),
    }


def test_the_readme_is_a_front_door():
    """Well under 300 lines, with the test command `.ci/run` reads."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 300
    assert re.search(r"<!-- test-command -->\n```bash\n.*pytest -q -n 2 --dist loadfile\n```", text)
