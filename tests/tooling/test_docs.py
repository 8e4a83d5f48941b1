"""The documentation stays true: README.md and docs/*.md are checked as code.

- every fenced block names its language; ``bash``/``sh`` blocks parse (``bash -n``), ``python`` blocks compile
  (output is fenced as ``text``);
- every relative link (and image) points at a file or folder that exists (anchors are not checked);
- the README is short (< 200 lines) and its first two code blocks are the two one-line commands for a fresh
  clone, each running a script in ``scripts/`` (the test one runs ``.ci/run``'s README test step, found by its
  marker comment);
- no file tracked by git carries a numbered work-period label, in its name or its text: names say what a file
  holds (device, case, commit), not when it was made.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import List, NamedTuple

import pytest

from _paths import ROOT

README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 200
CI_RUN = ROOT / ".ci" / "run"
CI_TEST_MARKER = re.compile(r"^# The README.s test command:")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A numbered work period: the word, then a number ("... 3", "...-2"); and a file suffix like "_s3." or "_s2/".
_PERIOD_TEXT = re.compile(r"\bsessions?[ -]\d", re.IGNORECASE)
_PERIOD_NAME = re.compile(r"_s\d+(?:[._/]|$)")


class Block(NamedTuple):
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def _blocks(path: Path) -> List[Block]:
    blocks, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start, body = m.group(2), i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            pytest.fail(f"{path.relative_to(ROOT)}:{start + 1}: code fence {fence!r} is never closed")
        blocks.append(Block(path, start + 1, m.group(3).lower(), "\n".join(body) + "\n"))
        i += 1
    return blocks


def _prose(path: Path) -> str:
    """The file without its fenced blocks (links inside code are code)."""
    out, inside = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _FENCE.match(line)
        if inside is None and m:
            inside = m.group(2)
        elif inside is not None and line.strip().startswith(inside):
            inside = None
        elif inside is None:
            out.append(line)
    return "\n".join(out)


ALL_BLOCKS = [b for p in DOCS for b in _blocks(p)]


def test_the_docs_exist():
    assert (ROOT / "docs" / "README.md").is_file(), "docs/README.md (the index) is missing"
    assert len(DOCS) > 2 and ALL_BLOCKS


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=str)
def test_every_block_names_its_language(block):
    assert block.lang, (f"{block}: a fenced block without a language; use bash/python for code, text for output")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "console")], ids=str)
def test_shell_blocks_parse(block):
    res = subprocess.run(["bash", "-n"], input=block.text, text=True, capture_output=True)
    assert res.returncode == 0, f"{block}: bash -n fails:\n{res.stderr}\n--- block ---\n{block.text}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in ("python", "py")], ids=str)
def test_python_blocks_compile(block):
    try:
        compile(block.text, str(block), "exec")
    except SyntaxError as exc:
        pytest.fail(f"{block}: does not compile ({exc}); if it is output, fence it as text\n{block.text}")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in _LINK.findall(_prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in this file
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to files that do not exist: {broken}"


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES - 1}"
    first_two = _blocks(README)[:2]
    assert len(first_two) == 2
    for block, script in zip(first_two, ("scripts/setup_and_demo.sh", "scripts/setup_and_test.sh")):
        commands = [ln for ln in block.text.splitlines() if ln.strip()]
        assert len(commands) == 1, f"{block}: must be ONE copy-pasteable line, found {len(commands)}"
        assert script in commands[0], f"{block}: expected the fresh-clone command to run {script}: {commands[0]!r}"
        assert (ROOT / script).is_file(), f"{script} is missing"


def test_the_test_script_runs_the_ci_test_step():
    """setup_and_test.sh runs .ci/run up to its README test step: the marker must be there, followed by pytest or
    scripts/run_tests.sh (the one pytest command)."""
    lines = CI_RUN.read_text(encoding="utf-8").splitlines()
    marked = [i for i, ln in enumerate(lines) if CI_TEST_MARKER.match(ln)]
    assert len(marked) == 1, f".ci/run: expected one line matching {CI_TEST_MARKER.pattern!r}, found {len(marked)}"
    command = lines[marked[0] + 1] if marked[0] + 1 < len(lines) else ""
    assert "pytest" in command or "scripts/run_tests.sh" in command, \
        f".ci/run: the line after the README test marker runs neither pytest nor scripts/run_tests.sh: {command!r}"
    if "scripts/run_tests.sh" in command:
        assert "pytest" in (ROOT / "scripts" / "run_tests.sh").read_text(encoding="utf-8")
    script = (ROOT / "scripts" / "setup_and_test.sh").read_text(encoding="utf-8")
    assert "The README.s test command:" in script, "scripts/setup_and_test.sh no longer looks for .ci/run's marker"


def _tracked_files() -> List[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (no .git): the tracked files are unknown")
    res = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"git ls-files failed: {res.stderr.decode(errors='replace').strip()}")
    return [f for f in res.stdout.decode().split("\0") if f]


def test_no_work_period_labels_in_tracked_files():
    bad_names, bad_text = [], []
    for rel in _tracked_files():
        if _PERIOD_NAME.search(rel):
            bad_names.append(rel)
        path = ROOT / rel
        if not path.is_file():
            continue  # deleted in the working tree
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # binary (images, compressed traces)
        for n, line in enumerate(text.splitlines(), 1):
            if _PERIOD_TEXT.search(line):
                bad_text.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not bad_names, (f"file names with a work-period suffix (name files by device, case and commit or date "
                           f"instead): {bad_names}")
    assert not bad_text, ("numbered work-period labels (say which commit or date instead; measurements belong in "
                          "benchmarks/results/README.md):\n" + "\n".join(bad_text))
