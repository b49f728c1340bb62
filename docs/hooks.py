"""mkdocs hooks: put the benchmark README, reports and saved results into the site.

The pages live in ``bench/`` beside the benchmarks, and link to the docs as ``../docs/...``;
the docs link to them as ``../bench/...``. Both read right on a repository browser. In the site
``bench/`` sits inside the docs, so the links lose the step out of ``docs/``.

The Results menu lists the newest report of each name (``bench/report.py``'s
``reports_by_name``: names and dates come from the file names), so that a new report takes
its predecessor's place there by being added. The earlier ones stay in the site, out of the
menu: a generated Earlier reports page lists them, each one's heading says it is superseded,
and a note under it links to the report that superseded it; the newest links back to them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.report import ReportFile, reports_by_name  # noqa: E402  (the repository root, just above)

REPORTS_DIR = _ROOT / "bench" / "reports"  # what the menu is made of (a test points it elsewhere)
EARLIER = "bench/reports/earlier.md"  # the generated page of earlier reports
_TO_BENCH = re.compile(r"\]\(((?:\.\./)*)\.\./bench/")  # docs page -> ../bench/x
_TO_DOCS = re.compile(r"\]\(((?:\.\./)+)docs/")  # bench page -> ../docs/x


def _uri(rep: ReportFile) -> str:
    return f"bench/reports/{rep.path.name}"


def _entry(rep: ReportFile) -> str:
    return f"{rep.title} ({rep.label})"


def _superseded() -> dict[str, tuple[ReportFile, ReportFile]]:
    """Site path of each earlier report -> (that report, the newest of its name)."""
    return {_uri(old): (old, reps[0]) for reps in reports_by_name(REPORTS_DIR).values() for old in reps[1:]}


def earlier_page() -> str:
    """The Earlier reports page: every report a newer one of its name superseded."""
    lines = ["# Earlier reports", "",
             "The Results menu shows the newest report of each benchmark. These are the earlier ones, kept for",
             "the record: their figures are those of the code and the machine they name, at their date.", "",
             "| report | date | machine | superseded by |", "|---|---|---|---|"]
    for old, new in _superseded().values():
        lines.append(f"| [{old.title}]({old.path.name}) | {old.label} | {old.hardware} | "
                     f"[{_entry(new)}]({new.path.name}) |")
    return "\n".join(lines) + "\n"


def on_config(config):
    """List the newest report of each name under Results in the navigation, titled by its
    heading and date, and the page of earlier ones after them."""
    groups = reports_by_name(REPORTS_DIR)
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Results" in item:
            item["Results"].extend({_entry(reps[0]): _uri(reps[0])} for reps in groups.values())
            if any(len(reps) > 1 for reps in groups.values()):
                item["Results"].append({"Earlier reports": EARLIER})
    return config


def on_files(files: Files, config) -> Files:
    bench = _ROOT / "bench"
    superseded = _superseded()
    for path in [bench / "README.md", *sorted((bench / "results").glob("*.json"))]:
        files.append(File.generated(config, path.relative_to(_ROOT).as_posix(), abs_src_path=str(path)))
    for reps in reports_by_name(REPORTS_DIR).values():
        for rep in reps:
            inclusion = InclusionLevel.NOT_IN_NAV if _uri(rep) in superseded else InclusionLevel.UNDEFINED
            files.append(File.generated(config, _uri(rep), abs_src_path=str(rep.path), inclusion=inclusion))
    if superseded:
        files.append(File.generated(config, EARLIER, content=earlier_page()))
    return files


def _mark(markdown: str, src_uri: str) -> str:
    """A report's page as the site shows it: an earlier one marked superseded under a heading
    that says so, the newest with links to the earlier ones of its name."""
    groups = {_uri(r): reps for reps in reports_by_name(REPORTS_DIR).values() for r in reps}
    reps = groups.get(src_uri)
    if not reps:
        return markdown
    heading, _, rest = markdown.partition("\n")
    me = next(r for r in reps if _uri(r) == src_uri)
    if me is reps[0]:
        if len(reps) == 1:
            return markdown
        links = ", ".join(f"[{r.label} ({r.hardware})]({r.path.name})" for r in reps[1:])
        return f"{heading}\n\nEarlier reports of this benchmark, superseded by this one: {links}.\n{rest}"
    new = reps[0]
    note = (f'!!! warning "Superseded"\n    A newer report of this benchmark supersedes this one: '
            f"[{_entry(new)}]({new.path.name}).\n    This one is kept for the record, with the other "
            f"[earlier reports]({Path(EARLIER).name}).\n")
    dated = me.date in heading  # a heading that gives its date already
    return f"{heading} ({'' if dated else me.label + ', '}superseded)\n\n{note}{rest}"


def on_page_markdown(markdown: str, page, config, files) -> str:
    src = page.file.src_uri
    if src.startswith("bench/"):
        return _TO_DOCS.sub(r"](\1", _mark(markdown, src))
    return _TO_BENCH.sub(r"](\1bench/", markdown)
