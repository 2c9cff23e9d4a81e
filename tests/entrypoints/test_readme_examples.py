"""README.md's serving examples, run as written: the server command and the curl command of
its sh block (with real curl), then its Python block in a subprocess. Only the port changes,
by substitution, so that the test does not need port 8000 free."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.test_openai_server import free_port, wait_healthy

pytestmark = [pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README_PORT = "8000"


def _serving_blocks() -> dict[str, str]:
    """The code blocks of the README's serving section, by language."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Serve it", 1)[1].split("\n## ", 1)[0]
    blocks = dict(re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL))
    assert set(blocks) == {"sh", "python"}, blocks
    return blocks


def test_readme_serving_examples(default_model_path: Path, tmp_path: Path) -> None:
    blocks = _serving_blocks()
    port = str(free_port())
    serve_command, curl_command = blocks["sh"].replace(README_PORT, port).split("\n", 1)
    python_code = blocks["python"].replace(README_PORT, port)
    assert serve_command.startswith(".venv/bin/python -m v1 serve") and "curl" in curl_command

    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {serve_command}"], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", log)
        curl = subprocess.run(
            ["bash", "-c", curl_command], capture_output=True, text=True, timeout=120, check=True
        )
        response = json.loads(curl.stdout)
        assert response["model"] == "SmolLM2-135M-Instruct", response
        assert response["choices"][0]["message"]["content"]

        python = subprocess.run(
            [sys.executable, "-c", python_code], capture_output=True, text=True, timeout=120
        )
        assert python.returncode == 0, python.stderr
        assert python.stdout.strip()
    finally:
        server.kill()
        server.wait()
