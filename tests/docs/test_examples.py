"""Every code block in README.md, docs/ and bench/ is run here, or says why it is not.

The convention (docs/development.md): ``bash`` and ``python`` blocks run, in order, one page per
empty temporary folder, with ``zbsearch`` being this checkout's command. A block right after
``<!-- illustrative: REASON -->`` is only checked for syntax; one right after
``<!-- file: NAME -->`` is written to NAME for the blocks after it. ``json`` and ``text`` blocks
are data. Anything else fails, so that no example is left unchecked by accident.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), ROOT / "bench" / "README.md",
                *(ROOT / "bench" / "reports").glob("*.md")])
RUN = ("bash", "python")
DATA = ("json", "text")
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(illustrative|file):\s*(.*?)\s*-->$")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    mark: tuple[str, str] | None  # ("illustrative", reason) or ("file", name)

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: code block never closed"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(before)
        found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           (mark.group(1), mark.group(2)) if mark else None))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def test_every_block_is_run_or_marked():
    bad = []
    for b in ALL:
        if b.lang not in RUN + DATA:
            bad.append(f"{b}: fence it as one of {', '.join(RUN + DATA)}")
        elif b.mark and b.mark[0] == "illustrative" and (b.lang not in RUN or not b.mark[1]):
            bad.append(f"{b}: 'illustrative' is for bash or python blocks, with a reason")
        elif b.mark and b.mark[0] == "file" and not re.fullmatch(r"[\w.-]+", b.mark[1]):
            bad.append(f"{b}: 'file:' needs a plain file name, not {b.mark[1]!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in RUN and b.mark], ids=str)
def test_blocks_not_run_still_parse(block):
    if block.lang == "python":
        compile(block.code, str(block), "exec")
    elif block.mark[0] == "illustrative":
        r = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert r.returncode == 0, f"{block}: {r.stderr}"


def test_quickstart_is_in_the_first_screen_and_run():
    readme = (ROOT / "README.md").read_text().splitlines()
    start = readme.index("## Quickstart")
    assert start < 40, f"the Quickstart starts at line {start + 1}"
    first = next(b for b in blocks(ROOT / "README.md") if b.line > start and b.lang == "bash")
    assert first.mark is None, "the Quickstart block must be run (CI runs it against the installed wheel)"
    assert "cd " not in first.code and "examples/" not in first.code, "the Quickstart must not need the checkout"


def test_relative_links_resolve():
    missing = []
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, "\n".join(missing)


def _env(tmp: Path) -> dict:
    """``zbsearch`` on PATH as this checkout's command, whatever is installed."""
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "zbsearch"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m zbsearch "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT), MPLBACKEND="Agg",
               COLUMNS="100")
    return env


RUN_PAGES = [p for p in PAGES if any(b.lang in RUN and (b.mark is None or b.mark[0] == "file") for b in blocks(p))]


def run_page(page: Path, tmp: Path) -> str | None:
    """Run a page's blocks in order in ``tmp``; the first failure, or None."""
    env = _env(tmp)
    for n, b in enumerate(blocks(page)):
        if b.mark and b.mark[0] == "file":
            (tmp / b.mark[1]).write_text(b.code)
            continue
        if b.lang not in RUN or b.mark:
            continue
        if b.lang == "bash":
            cmd = ["bash", "-e", "-o", "pipefail", "-c", b.code]
        else:
            script = tmp / f"_block{n}.py"
            script.write_text(b.code)
            cmd = [sys.executable, script.name]
        try:
            r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"{b} ran past 300 s:\n{b.code}"
        if r.returncode != 0:
            return f"{b} failed (exit {r.returncode}):\n{b.code}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return None


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory):
    """The selected pages, run two at a time (most of a page's time is starting Python and torch)."""
    wanted = {item.callspec.params["page"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_page_examples_run"}
    hf = importlib.util.find_spec("transformers") is not None
    wanted = {p for p in wanted if hf or not _needs_hf(p)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {p: pool.submit(run_page, p, tmp_path_factory.mktemp(p.stem)) for p in sorted(wanted)}
        return {p: f.result() for p, f in futures.items()}


def _needs_hf(page: Path) -> bool:
    return any("models.hf" in b.code or "--hf" in b.code for b in blocks(page) if b.mark is None)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, page_runs):
    if _needs_hf(page):
        pytest.importorskip("transformers")
    failure = page_runs[page]
    assert failure is None, failure
