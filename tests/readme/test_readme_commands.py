"""The shell blocks of README.md and docs/*.md, as a user copies them (documented commands that did not work).

Every fenced shell block of those pages is preceded by a marker comment that says what the suite does
with it:

    <!-- readme: run -->                                   run as printed, in README order
    <!-- readme: run; given: data.jsonl.zst tokenizer.model -->   ... after the suite made these inputs
    <!-- readme: skip: needs a GPU|a cluster|the network: WHY -->
    <!-- readme: skip: long: WHY; tests/PATH runs it -->     (names the test that runs it)

A ```text block marked ``<!-- readme: output -->`` right after a run block is what that block prints:
each of its lines must appear in one line of the block's output (stdout and stderr), ``...`` standing for
any text (a hash, a pid, a time). The documented output is checked, not only the exit code.

An unmarked shell block, a shell command in an indented (unfenced) block, an output block that follows no
run block, or an unknown "given" fails :func:`test_every_shell_block_is_marked`. The run blocks execute with ``bash -e -o pipefail`` in one
sandbox, in order (README.md, then docs/ by name), as a newcomer who ran the demo would: a fresh HOME (so ``~/.nemoflow`` is the
default work dir), no NEMOFLOW_* settings, the venv on PATH, the session's Prefect server as the API
the demo recorded in the profile, and a scratch directory as the working directory. "given" inputs are
made first: ``data.jsonl.zst`` (KJV chapters), ``tokenizer.model`` (Mixtral's, from mistral-common) and
"the demo's checkpoint" (a tiny real Llama where the demo writes its checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_BIN

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"^<!-- readme: (run(?:; given: (?P<given>[^>]+?))?|skip: (?P<reason>.+?)|output) -->$")
SKIP_KINDS = ("needs a GPU", "needs a cluster", "needs the network", "long")
GIVEN = {"data.jsonl.zst", "tokenizer.model", "the demo's checkpoint"}
# Commands that start a shell line of an indented block, i.e. a command left unfenced and unmarked.
COMMAND_WORDS = ("nemoflow ", "prefect ", "scripts/", "python ", "kubectl ", "sbatch ", "curl ", "export ", "podman ")


@dataclasses.dataclass
class Block:
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marker: str | None
    given: tuple[str, ...] = ()
    skip: str | None = None
    page: str = "README.md"
    prints: list[str] = dataclasses.field(default_factory=list)  # the documented output's lines

    @property
    def runs(self) -> bool:
        return self.marker is not None and self.skip is None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text.strip().splitlines()[0] if self.text.strip() else '(empty)'}"


def missing_output(expected: list[str], output: str) -> list[str]:
    """The expected lines that no line of ``output`` matches (``...`` = any text, the rest in order)."""
    lines = output.splitlines()

    def matches(pattern: str, line: str) -> bool:
        regex = ".*?".join(re.escape(part) for part in pattern.split("..."))
        return re.search(regex, line) is not None

    return [e for e in expected if not any(matches(e.strip(), line) for line in lines)]


def blocks(text: str, page: str = "README.md") -> tuple[list[Block], list[str]]:
    """The fenced blocks (with their markers) and the problems found on the way."""
    lines = text.splitlines()
    found: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(\s*)```(\S*)\s*$", line)
        if not fence:
            indented = re.match(r"^( {4,})(\S.*)$", line)
            if indented and (i == 0 or not lines[i - 1].strip()) and indented.group(2).startswith(COMMAND_WORDS):
                problems.append(f"{page}:{i + 1}: a shell command in an indented block: fence it (```bash) and mark it")
            i += 1
            continue
        start = i
        language = fence.group(2)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            problems.append(f"{page}:{start + 1}: unclosed code fence")
            break
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        match = MARKER.match(previous.strip())
        marker = match.group(1) if match else None
        block = Block(start + 1, language, "\n".join(lines[start + 1 : end]) + "\n", marker, page=page)
        if marker == "output":
            shown = found[-1] if found else None
            if shown is None or shown.language not in SHELL or not shown.runs:
                problems.append(f"{block}: an output block must follow the run block whose output it shows")
            else:
                shown.prints = [line for line in block.text.splitlines() if line.strip()]
            i = end + 1
            continue
        if match and match.group("given"):
            block.given = _given(match.group("given"))
        if match and match.group("reason"):
            block.skip = match.group("reason")
        found.append(block)
        i = end + 1
    return found, problems


def _given(text: str) -> tuple[str, ...]:
    """ "data.jsonl.zst tokenizer.model" -> the names; "the demo's checkpoint" stays one name."""
    text = text.strip()
    return (text,) if text in GIVEN else tuple(text.split())


def all_blocks() -> tuple[list[Block], list[str]]:
    """Every page's blocks, README.md first, then docs/ by name."""
    found: list[Block] = []
    problems: list[str] = []
    for path in PAGES:
        page_blocks, page_problems = blocks(path.read_text(), str(path.relative_to(REPO)))
        found += page_blocks
        problems += page_problems
    return found, problems


def shell_blocks() -> list[Block]:
    return [b for b in all_blocks()[0] if b.language in SHELL]


def test_every_shell_block_is_marked():
    found, problems = all_blocks()
    for block in found:
        if not block.language:
            problems.append(f"README.md:{block.line}: a fence without a language (```bash, ```text, ```yaml)")
        elif block.language in SHELL and block.marker is None:
            problems.append(f"{block}: no '<!-- readme: run -->' or '<!-- readme: skip: ... -->' before it")
        elif block.language not in SHELL and block.marker is not None:
            problems.append(f"{block}: a marker on a {block.language} block (only shell blocks run)")
        elif block.language in SHELL and block.marker == "output":
            problems.append(f"{block}: an output marker on a shell block (output is a ```text block)")
        for name in block.given:
            if name not in GIVEN:
                problems.append(f"{block}: unknown given {name!r} (known: {sorted(GIVEN)})")
        if block.skip is not None:
            if not block.skip.startswith(SKIP_KINDS):
                problems.append(f"{block}: skip reason {block.skip!r} is none of {SKIP_KINDS}")
            if block.skip.startswith("long"):
                tests = re.findall(r"tests/\S+\.py", block.skip)
                if not tests or not all((REPO / t).exists() for t in tests):
                    problems.append(f"{block}: a long block names the test that runs it (tests/....py): {block.skip!r}")
    assert not problems, "\n".join(problems)
    shells = [b for b in found if b.language in SHELL]
    assert sum(b.runs for b in shells) >= 4, "the documented quick commands must run"
    assert sum(bool(b.prints) for b in shells) >= 2, "documented output is checked"
    print("\nDocumented shell blocks not run by the suite:")
    for block in shells:
        if not block.runs:
            print(f"  {block}  [{block.skip}]")


def test_the_collector_flags_unmarked_and_indented_commands():
    """The collector itself: an unmarked shell block and an unfenced command are problems."""
    text = "intro\n\n```bash\nnemoflow settings\n```\n\nmore\n\n    nemoflow jobs\n\n<!-- readme: run -->\n```bash\nls\n```\n"
    found, problems = blocks(text, "docs/x.md")
    assert [b.marker for b in found] == [None, "run"]
    assert problems == ["docs/x.md:9: a shell command in an indented block: fence it (```bash) and mark it"]


def test_an_output_block_belongs_to_the_run_block_before_it():
    text = (
        "<!-- readme: run -->\n```bash\nnemoflow render\n```\n<!-- readme: output -->\n```text\n"
        "manifests/job-train-...yaml\n6 files in manifests/\n```\n\n"
        "<!-- readme: skip: needs a GPU: x -->\n```bash\nnvidia-smi\n```\n<!-- readme: output -->\n```text\nGPU 0\n```\n"
    )
    found, problems = blocks(text, "docs/x.md")
    assert found[0].prints == ["manifests/job-train-...yaml", "6 files in manifests/"]
    assert problems == ["docs/x.md:16: GPU 0: an output block must follow the run block whose output it shows"]


def test_documented_output_is_matched_line_by_line_with_wildcards():
    printed = "manifests/job-train-465301a65b.yaml\n6 files in manifests/; review\n"
    assert missing_output(["manifests/job-train-...yaml", "6 files in ..."], printed) == []
    assert missing_output(["manifests/job-validate-...yaml", "7 files"], printed) == [
        "manifests/job-validate-...yaml",
        "7 files",
    ]


# ---------------------------------------------------------------- running the run blocks


def _make_given(name: str, cwd: Path, home: Path, tokenizer: Path, chapters: list[str]) -> None:
    if name == "tokenizer.model":
        (cwd / name).write_bytes(tokenizer.read_bytes())
    elif name == "data.jsonl.zst":
        import zstandard

        lines = "".join(json.dumps({"text": chapter}) + "\n" for chapter in chapters[:60])
        (cwd / name).write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    elif name == "the demo's checkpoint":
        from tests.serve.conftest import build_tiny_checkpoint

        dest = home / ".nemoflow/work/runs/llama-readme0000/checkpoints/epoch_0_step_39/model/consolidated"
        dest.mkdir(parents=True)
        build_tiny_checkpoint(dest, tokenizer)
    else:
        raise AssertionError(f"unknown given {name!r}")


@pytest.fixture
def newcomer(tmp_path, prefect_server):
    """A newcomer's shell after the demo: fresh HOME, venv on PATH, the demo's Prefect API, no NEMOFLOW_*."""
    home = tmp_path / "home"
    cwd = tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMOFLOW_", "PREFECT_"))}
    env.update(
        HOME=str(home),
        PATH=f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(REPO),
        PREFECT_API_URL=prefect_server,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    yield home, cwd, env
    # Whatever a failed block left running (a server it started) is stopped.
    stop = "from infra import services\nfor s in services.list_services(): services.stop_service(s.name)"
    subprocess.run([str(VENV_BIN / "python"), "-c", stop], cwd=REPO, env=env, capture_output=True, timeout=120)


@pytest.mark.prefect
@pytest.mark.slow
def test_run_blocks_work_as_printed(newcomer, mixtral_tokenizer_model, kjv_chapters):
    home, cwd, env = newcomer
    runs = [b for b in shell_blocks() if b.runs]
    assert runs
    timings = []
    for block in runs:
        for name in block.given:
            _make_given(name, cwd, home, mixtral_tokenizer_model, kjv_chapters)
        started = time.monotonic()
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block.text],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        took = time.monotonic() - started
        timings.append((took, str(block)))
        assert proc.returncode == 0, (
            f"{block} failed (exit {proc.returncode}) as printed:\n{block.text}\n"
            f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
        )
        missing = missing_output(block.prints, proc.stdout + "\n" + proc.stderr)
        assert not missing, (
            f"{block} did not print what the page shows: {missing}\n"
            f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
        )
    print("\nDocumented run blocks:")
    for took, what in timings:
        print(f"  {took:5.1f} s  {what}")
