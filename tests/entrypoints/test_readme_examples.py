"""README.md's commands and code blocks, run or checked as written, and the links of README.md
and docs/*.md.

Run as written (only the port and the interpreter change, by substitution: the test must not
need port 8000 free, and it runs this checkout's `v1`):
- the Python quickstart, in a subprocess;
- the server quickstart: its `serve` command, its curl command with real curl, then its
  `openai` block in a subprocess;
- docs/serving.md's server command, curl command and client block (every endpoint it shows).

Checked, not run (each takes minutes to an hour):
- `make demo`, `make test` (the two commands) and every `make ...` the README names in its text
  (`make bench`, `make bench-llamacpp`): `make -n TARGET` resolves the target and its recipe;
- the headline table's benchmark commands: each script's `--help` lists every flag the command
  passes, and every bold figure of a row is a number in the committed output the row names, to
  the precision written (16.5 matches 16.51, 99 matches 98.7).

Every fenced block of README.md must be one this file runs, so that a new block cannot go
untested.
"""

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.bench.script_help import run_help
from tests.entrypoints.test_openai_server import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_PORT = "8000"
VENV_PYTHON = ".venv/bin/python"

# (section, language) of every fenced block README.md may have: the tests below run each.
README_BLOCKS = [
    ("Two commands", "sh"),  # test_two_commands
    ("Python quickstart", "python"),  # test_python_quickstart
    ("Server quickstart", "sh"),  # test_server_quickstart
    ("Server quickstart", "python"),  # test_server_quickstart
]


def _without_code(text: str) -> str:
    """The text outside fenced blocks (a `# comment` in a shell block is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def _blocks(path: Path) -> list[tuple[str, str, str]]:
    """(section title, language, code) of every fenced block of `path`, in order."""
    blocks = []
    for section in ("\n" + path.read_text()).split("\n## ")[1:]:
        title = section.split("\n", 1)[0]
        for lang, code in re.findall(r"^```(\w*)\n(.*?)^```", section, re.DOTALL | re.MULTILINE):
            blocks.append((title, lang, code))
    return blocks


def _block(path: Path, section: str, lang: str) -> str:
    (code,) = [c for s, lang_, c in _blocks(path) if s == section and lang_ == lang]
    return code


def _run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    return result.stdout


@contextmanager
def _server(serve_command: str, port: str, log: Path) -> Iterator[None]:
    """The documented `serve` command, on `port`, with this interpreter, until the block ends."""
    assert serve_command.startswith(f"{VENV_PYTHON} -m v1 serve"), serve_command
    command = serve_command.replace(VENV_PYTHON, sys.executable, 1)
    with open(log, "wb") as out:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", log)
        yield
    finally:
        server.kill()
        server.wait()


def _check_serving_blocks(sh: str, python: str, tmp_path: Path) -> None:
    """A shell block of two commands (`serve`, then curl of a chat completion) and a Python
    block against that server: both run as written, on a free port."""
    port = str(free_port())
    serve_command, curl_command = sh.replace(README_PORT, port).split("\n", 1)
    assert curl_command.startswith("curl"), curl_command
    with _server(serve_command, port, tmp_path / "server.log"):
        curl = subprocess.run(
            ["bash", "-c", curl_command], capture_output=True, text=True, timeout=120, check=True
        )
        response = json.loads(curl.stdout)
        assert response["model"] == "SmolLM2-135M-Instruct", response
        assert response["choices"][0]["message"]["content"]
        _run_python(python.replace(README_PORT, port))


def test_every_readme_block_is_tested() -> None:
    assert [(s, lang) for s, lang, _ in _blocks(README)] == README_BLOCKS


def _make_dry_run(target: str) -> None:
    result = subprocess.run(
        ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"make -n {target}: {result.stderr}"


def test_two_commands() -> None:
    """Checked, not run: `make demo` installs and loads the model, `make test` runs the suite."""
    commands = [
        line.split("#")[0].split()
        for line in _block(README, "Two commands", "sh").strip().splitlines()
    ]
    assert [c[:1] for c in commands] == [["make"], ["make"]], commands
    for _, target in commands:
        _make_dry_run(target)


def test_make_targets_named_in_the_readme() -> None:
    """Checked, not run: every `make TARGET` the README's text names (an hour for `bench`)."""
    targets = set(re.findall(r"`make ([\w-]+)`", _without_code(README.read_text())))
    assert {"bench", "bench-llamacpp"} <= targets, targets
    for target in sorted(targets):
        _make_dry_run(target)


class HeadlineRow(NamedTuple):
    figures: list[str]  # the bold figures of the row
    cpu: str  # the CPU column: the machine and which kernel library ran
    command: str
    output: Path  # the committed output of `command`


def _headline_rows() -> list[HeadlineRow]:
    section = README.read_text().split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[3].startswith("`bench/"):
            continue
        rows.append(HeadlineRow(re.findall(r"\*\*([^*]+)\*\*", cells[1]), cells[2],
                                cells[3].strip("`"), ROOT / cells[4].strip("`")))
    return rows


def _recorded_class(output: str) -> str | None:
    """The instruction-set class an output says it ran on ("AVX2" where v1 ran its
    x86_64_v3 library, "AVX-512" where the CPU has AVX-512 and v1 its best library), or None
    where it records no CPU."""
    if sizes_class := re.search(r"CPU class (avx512|avx2)", output):  # bench_sizes' header
        return {"avx512": "AVX-512", "avx2": "AVX2"}[sizes_class.group(1)]
    flags = re.search(r'"cpu": \{[^}]*"flags": \[([^\]]*)\]', output)
    if flags is None:
        return None
    if "x86_64_v3" in output:
        return "AVX2"
    return "AVX-512" if '"avx512f"' in flags.group(1) else "AVX2"


def _matches(figure: str, numbers: list[float]) -> bool:
    """Whether `figure` (as written, "16.5x", "0.190") is one of `numbers` rounded to its
    precision."""
    match = re.search(r"\d+(?:\.(\d+))?", figure)
    assert match, figure
    value, decimals = float(match.group(0)), len(match.group(1) or "")
    return any(abs(n - value) <= 0.5 * 10**-decimals + 1e-9 for n in numbers)


def test_headline_figures_come_from_committed_outputs() -> None:
    rows = _headline_rows()
    assert len(rows) >= 8, rows
    for row in rows:
        assert row.figures, row.command
        assert row.output.is_file(), row.output
        numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", row.output.read_text())]
        for figure in row.figures:
            assert _matches(figure, numbers), f"{figure} is not in {row.output} ({row.command})"


def test_headline_rows_name_the_cpu_their_output_records() -> None:
    """Each row says which instruction-set class its figure ran on, and where the output
    records its CPU (and the library that ran), the row says the same."""
    for row in _headline_rows():
        named = [c for c in ("AVX-512", "AVX2") if c in row.cpu]
        assert len(named) == 1, f"{row.output.name}: the CPU cell {row.cpu!r} names no one class"
        recorded = _recorded_class(row.output.read_text())
        assert recorded in (None, named[0]), f"{row.output.name}: {row.cpu!r}, ran {recorded}"


@pytest.mark.slow
def test_headline_commands_take_their_flags() -> None:
    """Checked, not run: every flag of each command is in its script's `--help` (all the
    scripts' --help from one helper process: see tests/bench/script_help.py)."""
    flags_by_script: dict[str, set[str]] = {}
    for row in _headline_rows():
        script, *args = row.command.split()
        flags_by_script.setdefault(script, set()).update(a for a in args if a.startswith("--"))
    helps = run_help([ROOT / script for script in flags_by_script], cwd=ROOT)
    for script, flags in flags_by_script.items():
        help_ = helps[ROOT / script]
        out = help_.stdout + help_.stderr
        assert help_.returncode == 0, f"{script} --help:\n{out}"
        for flag in flags:
            assert re.search(rf"{re.escape(flag)}\b", out), f"{script} has no {flag}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _without_code(path.read_text()), re.M)}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link and image of the page names a file that exists, and an anchor a
    heading of that file."""
    links = re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text()))
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{page.name}: {link} names no file"
        if anchor:
            assert anchor in _anchors(target), f"{page.name}: {link} names no heading"


def test_readme_links_every_doc() -> None:
    assert len(DOCS) >= 7
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", README.read_text()))
    assert linked == {p.relative_to(ROOT).as_posix() for p in DOCS}


@pytest.mark.model
@pytest.mark.slow
def test_python_quickstart(default_model_path: Path) -> None:
    out = _run_python(_block(README, "Python quickstart", "python"))
    assert "prefix_cache_hit_rate" in out, out


@pytest.mark.model
@pytest.mark.slow
def test_server_quickstart(default_model_path: Path, tmp_path: Path) -> None:
    _check_serving_blocks(
        _block(README, "Server quickstart", "sh"),
        _block(README, "Server quickstart", "python"),
        tmp_path,
    )


@pytest.mark.model
@pytest.mark.slow
def test_docs_serving_examples(default_model_path: Path, tmp_path: Path) -> None:
    page = ROOT / "docs" / "serving.md"
    section = "The OpenAI-compatible server"
    _check_serving_blocks(_block(page, section, "sh"), _block(page, section, "python"), tmp_path)
