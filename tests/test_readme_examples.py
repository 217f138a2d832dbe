"""The README's examples work as written (issue 32): its curl and `openai` SDK snippets, taken from the fenced blocks
marked `<!-- readme-test: NAME -->`, run against a live `stagemesh up` with make serve's settings. The only change
made to a snippet is the gateway's address: the mesh here listens on a free port instead of 8000."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

README = os.path.join(ROOT, "README.md")
README_URL = "http://127.0.0.1:8000"  # where make serve listens, as the README's snippets say


def snippet(name: str) -> str:
    """The body of the fenced block right after the marker `<!-- readme-test: name -->` in README.md."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    m = re.search(rf"<!-- readme-test: {re.escape(name)} -->\s*\n```[\w-]*\n(.*?)\n```", text, re.S)
    assert m, f"README.md has no fenced block marked <!-- readme-test: {name} -->"
    return m.group(1)


def at(code: str, url: str) -> str:
    assert README_URL in code, f"the snippet does not talk to {README_URL}, where make serve listens"
    return code.replace(README_URL, url)


@pytest.fixture(scope="module")
def gateway(serve_gateway):  # make serve: 2 stages, up's defaults (shared with test_loadtest: tests/conftest.py)
    return serve_gateway


def test_curl_snippet(gateway):
    code = at(snippet("curl"), gateway.url)
    assert code.lstrip().startswith("curl ")
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"].strip()
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")


def run_python_snippet(name: str, gateway, tmp_path) -> str:
    """Run the README's Python block `name` against the gateway; its stdout (the run must succeed)."""
    script = tmp_path / f"readme_{name.replace('-', '_')}.py"
    script.write_text(at(snippet(name), gateway.url))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_sdk_snippet(gateway, tmp_path):
    assert run_python_snippet("sdk", gateway, tmp_path).strip(), "the SDK snippet printed no text"


def test_sdk_parse_snippet(gateway, tmp_path):
    """The structured-output snippet: the SDK validates the constrained answer into its pydantic model."""
    out = run_python_snippet("sdk-parse", gateway, tmp_path)
    # pydantic's repr quotes a string with '...' unless it holds a single quote, then with "..."
    quoted = r"""('[^']*'|"[^"]*")"""
    assert re.fullmatch(rf"name={quoted} country={quoted} size='(village|town|city)'", out.strip()), out
