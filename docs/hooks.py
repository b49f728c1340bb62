"""mkdocs hooks: put the benchmark README, reports and saved results into the site.

The pages live in ``bench/`` beside the benchmarks, and link to the docs as ``../docs/...``;
the docs link to them as ``../bench/...``. Both read right on a repository browser. In the site
``bench/`` sits inside the docs, so the links lose the step out of ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

_ROOT = Path(__file__).resolve().parent.parent
_TO_BENCH = re.compile(r"\]\(((?:\.\./)*)\.\./bench/")  # docs page -> ../bench/x
_TO_DOCS = re.compile(r"\]\(((?:\.\./)+)docs/")  # bench page -> ../docs/x


def _reports() -> list[Path]:
    return sorted((_ROOT / "bench" / "reports").glob("*.md"))


def on_config(config):
    """List every report under Results in the navigation, titled by its heading and date."""
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Results" in item:
            for path in _reports():
                title = path.read_text().splitlines()[0].lstrip("# ").strip()
                date = path.stem.rsplit("_", 1)[-1]
                item["Results"].append({f"{title} ({date})": f"bench/reports/{path.name}"})
    return config


def on_files(files: Files, config) -> Files:
    bench = _ROOT / "bench"
    paths = [bench / "README.md", *_reports(), *sorted((bench / "results").glob("*.json"))]
    for path in paths:
        files.append(File.generated(config, path.relative_to(_ROOT).as_posix(), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri.startswith("bench/"):
        return _TO_DOCS.sub(r"](\1", markdown)
    return _TO_BENCH.sub(r"](\1bench/", markdown)
