"""The docs site's Results menu (docs/hooks.py): the newest report of each benchmark, the earlier
ones reachable and marked superseded, derived from the report files' names alone."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed")

from mkdocs.config import load_config  # noqa: E402
from mkdocs.structure.files import Files, InclusionLevel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_DATED = re.compile(r"^([^_]+)_[^_]+_(\d{4}-\d{2}-\d{2})(?:-(\d+))?\.md$")


@pytest.fixture
def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _by_benchmark(folder: Path) -> dict[str, list[str]]:
    """File names per benchmark, newest first: the rule as bench/README.md states it."""
    out: dict[str, list[tuple[tuple[str, int], str]]] = {}
    for path in folder.glob("*.md"):
        found = _DATED.match(path.name)
        assert found, f"{path.name} is not named TOPIC_HARDWARE_DATE.md"
        out.setdefault(found[1], []).append(((found[2], int(found[3] or 1)), path.name))
    return {k: [name for _, name in sorted(v, reverse=True)] for k, v in out.items()}


def _menu(hooks) -> list[dict[str, str]]:
    config = {"nav": [{"Home": "index.md"}, {"Results": [{"Benchmarks": "bench/README.md"}]}]}
    return hooks.on_config(config)["nav"][1]["Results"][1:]


def _site_files() -> dict:
    """The files the site's plugins and hooks put into it (the mkdocs.yml of this checkout)."""
    config = load_config(str(ROOT / "mkdocs.yml"))
    return {f.src_uri: f for f in config.plugins.on_files(Files([]), config=config)}


def _page(uri: str):
    class File:
        src_uri = uri

    class Page:
        file = File()

    return Page()


def test_the_menu_holds_one_report_per_benchmark_its_newest(hooks):
    want = _by_benchmark(ROOT / "bench" / "reports")
    entries = _menu(hooks)
    got = [uri for entry in entries for uri in entry.values()]
    assert got == [f"bench/reports/{names[0]}" for _, names in sorted(want.items())] + ["bench/reports/earlier.md"]
    for entry in entries[:-1]:
        (title, uri), = entry.items()
        heading = (ROOT / uri).read_text().splitlines()[0].lstrip("# ")
        assert title.startswith(heading) and _DATED.match(Path(uri).name)[2] in title


def test_every_earlier_report_is_reachable_and_says_what_superseded_it(hooks):
    want = _by_benchmark(ROOT / "bench" / "reports")
    earlier = {old: names[0] for names in want.values() for old in names[1:]}
    assert earlier, "the reports hold earlier runs of some benchmark"
    site = _site_files()
    page = site["bench/reports/earlier.md"].content_string
    for old, new in earlier.items():
        assert site[f"bench/reports/{old}"].inclusion is InclusionLevel.NOT_IN_NAV  # out of the menu, in the site
        row = next(line for line in page.splitlines() if f"]({old})" in line)
        assert row.endswith(f"]({new}) |")
        text = (ROOT / "bench" / "reports" / old).read_text()
        shown = hooks.on_page_markdown(text, _page(f"bench/reports/{old}"), None, None)
        heading, _, rest = shown.partition("\n")
        assert heading.endswith("superseded)")
        note = rest.lstrip("\n").split("\n\n", 1)[0]  # right under the heading
        assert note.startswith('!!! warning "Superseded"') and f"]({new})" in note
        newest = hooks.on_page_markdown((ROOT / "bench" / "reports" / new).read_text(),
                                        _page(f"bench/reports/{new}"), None, None)
        assert f"]({old})" in newest and "superseded" not in newest.splitlines()[0]
    for names in want.values():
        assert site[f"bench/reports/{names[0]}"].inclusion is InclusionLevel.UNDEFINED


def test_a_new_report_takes_its_predecessors_place_in_the_menu(hooks, tmp_path, monkeypatch):
    monkeypatch.setattr(hooks, "REPORTS_DIR", tmp_path)

    def add(name: str, title: str) -> None:
        (tmp_path / name).write_text(f"# {title}\n\nfigures\n")

    add("alpha_xeon2c_2026-01-05.md", "Alpha")
    add("beta_epyc2c_2026-01-01.md", "Beta")
    assert _menu(hooks) == [{"Alpha (2026-01-05)": "bench/reports/alpha_xeon2c_2026-01-05.md"},
                            {"Beta (2026-01-01)": "bench/reports/beta_epyc2c_2026-01-01.md"}]
    add("alpha_epyc2c_2026-02-01.md", "Alpha")  # another machine, later
    add("alpha_epyc2c_2026-02-01-2.md", "Alpha")  # the day's second run
    assert _menu(hooks) == [{"Alpha (2026-02-01, run 2)": "bench/reports/alpha_epyc2c_2026-02-01-2.md"},
                            {"Beta (2026-01-01)": "bench/reports/beta_epyc2c_2026-01-01.md"},
                            {"Earlier reports": "bench/reports/earlier.md"}]
    rows = [line for line in hooks.earlier_page().splitlines() if line.startswith("| [")]
    newest = "[Alpha (2026-02-01, run 2)](alpha_epyc2c_2026-02-01-2.md)"
    assert rows == [f"| [Alpha](alpha_epyc2c_2026-02-01.md) | 2026-02-01 | epyc2c | {newest} |",
                    f"| [Alpha](alpha_xeon2c_2026-01-05.md) | 2026-01-05 | xeon2c | {newest} |"]
    add("alpha_xeon2c_2026-02-01.md", "Alpha")  # two reports of one day and run: which is newer is unknown
    with pytest.raises(ValueError, match="neither the later"):
        _menu(hooks)
    (tmp_path / "alpha_xeon2c_2026-02-01.md").unlink()
    add("notes.md", "Notes")
    with pytest.raises(ValueError, match="a report is named NAME_HARDWARE_DATE.md"):
        _menu(hooks)
