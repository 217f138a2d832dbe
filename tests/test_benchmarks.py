"""Every benchmark script imports (a renamed helper must not leave a benchmark that no longer runs) and answers
--help without starting anything; the scripts share one harness (services/testing/harness.py) instead of borrowing each
other's functions, and neither they nor the product import tests/ (nor the product benchmarks/)."""

import ast
import json
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import benchmarks
from services.testing import harness
from tests.conftest import starts_processes

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports, anywhere in it (inside functions too), as dotted names: `from a import b` gives
    both "a" and "a.b" (b may be a module)."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def is_script(name: str) -> bool:
    """A benchmark script: its module defines main() (what `python -m benchmarks.NAME` runs)."""
    tree = _tree(ROOT / "benchmarks" / f"{name}.py")
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


SCRIPTS = [m for m in MODULES if is_script(m)]


def test_there_are_benchmarks():
    assert {"compare_llamacpp", "memory", "overlap", "trace_overhead", "batching"} <= set(SCRIPTS)
    helpers = [m for m in MODULES if not is_script(m)]
    assert not helpers, f"benchmarks/ holds scripts only; move the helpers {helpers} into services/testing/"


@pytest.mark.parametrize("name", MODULES)
def test_benchmarks_borrow_from_no_script_and_not_from_tests(name):
    imports = imported_modules(ROOT / "benchmarks" / f"{name}.py")
    tests = sorted(m for m in imports if m == "tests" or m.startswith("tests."))
    assert not tests, f"benchmarks/{name}.py imports {tests}: move what it needs into services/testing/harness.py"
    scripts = sorted(m for m in imports if m.startswith("benchmarks.") and m.split(".")[1] in SCRIPTS
                     and m.split(".")[1] != name)
    assert not scripts, (f"benchmarks/{name}.py imports from the benchmark script(s) {scripts}: move what they "
                         "share into services/testing/harness.py")


def test_the_product_imports_neither_benchmarks_nor_tests():
    offenders = []
    for package in ("services", "shared", "loadtest"):
        for path in sorted((ROOT / package).rglob("*.py")):
            bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in ("benchmarks", "tests"))
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    assert not offenders, offenders


def test_a_run_without_out_gets_a_new_dated_results_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS_ROOT", str(tmp_path))
    first, second = harness.results_dir(None, "batching"), harness.results_dir(None, "batching")
    assert pathlib.Path(first).is_dir() and pathlib.Path(first).name.endswith("-batching")
    assert second == first + "-2"  # an earlier run's results are never overwritten
    given = tmp_path / "mine"
    assert harness.results_dir(str(given), "batching") == str(given) and given.is_dir()


def test_write_results_writes_the_json_and_the_markdown(tmp_path):
    path = harness.write_results(str(tmp_path), "batching", {"levels": [{"concurrency": 1, "tokens_per_s": 2.5}]},
                                 "| streams |\n| 1 |")
    assert json.loads(pathlib.Path(path).read_text()) == {"levels": [{"concurrency": 1, "tokens_per_s": 2.5}]}
    assert (tmp_path / "batching.md").read_text() == "| streams |\n| 1 |\n"


def test_a_report_keeps_what_the_script_printed(tmp_path, capsys):
    report = harness.Report("overlap", str(tmp_path))
    report.say("prefetch on / off throughput: 1.50x")
    assert report.write({"ratio": 1.5}) == str(tmp_path)
    assert "prefetch on / off throughput: 1.50x" in capsys.readouterr().out
    assert json.loads((tmp_path / "overlap.json").read_text()) == {
        "results": {"ratio": 1.5}, "printed": ["prefetch on / off throughput: 1.50x"]}
    assert "prefetch on / off throughput: 1.50x" in (tmp_path / "overlap.md").read_text()


def test_the_prediction_bound_drafts_exactly_what_stands():
    from benchmarks.prediction import drafting_bound, longest_runs
    text = [1, 2, 3, 4, 5, 6]
    answer = [1, 2, 9, 4, 5, 6]  # the text with one token changed
    assert longest_runs(answer, text) == [2, 1, 0, 3, 2, 1]
    assert longest_runs([7, 8, 7, 8, 7], text) == [0, 0, 3, 2, 1]  # the answer's own earlier tokens draft too
    flat = {"1": 10.0, "20": 10.0}  # rows free: each run of the text in one pass
    assert drafting_bound([answer], [text], flat) == pytest.approx(6 / 2)  # [1, 2, 9] and [4, 5, 6]
    steep = {str(r): 10.0 * r for r in range(1, 5)}  # a row costs a whole pass: drafting cannot win
    assert drafting_bound([answer], [text], steep) == pytest.approx(1.0)
    assert drafting_bound([[7, 7]], [text], flat) == 1.0  # nothing of the text in the answer


def test_level_percentiles_interpolate_between_ranks():
    assert harness._percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert harness._percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert harness._percentile([7.0], 99) == 7.0
    assert harness._percentile([], 50) != harness._percentile([], 50)  # NaN: no request, no figure


# One process answers every script's --help (a process each cost ~3 s of imports, 31 times): it imports each
# benchmark and runs its main() with argv [--help], and prints a JSON object {name: {"exit", "usage", "error"}}.
HELP_ALL = """
import contextlib, importlib, io, json, sys, traceback
out = {}
for name in sys.argv[1:]:
    printed = io.StringIO()
    try:
        module = importlib.import_module(f"benchmarks.{name}")
        sys.argv = [f"python -m benchmarks.{name}", "--help"]
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            module.main()
        out[name] = {"exit": "main() returned instead of exiting after --help", "usage": printed.getvalue()}
    except SystemExit as e:
        out[name] = {"exit": e.code, "usage": printed.getvalue()}
    except BaseException:
        out[name] = {"exit": None, "usage": printed.getvalue(), "error": traceback.format_exc()[-2000:]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
@starts_processes
def helps() -> dict:
    """{benchmark: what `--help` gave}, all of them from one fresh interpreter (not this one: a script's imports
    and argparse run as `python -m benchmarks.NAME --help` runs them)."""
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *MODULES], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_imports_and_answers_help(helps, name):
    got = helps[name]
    assert "error" not in got, f"benchmarks.{name}: {got['error']}"
    assert got["exit"] == 0 and "usage" in got["usage"].lower(), f"benchmarks.{name} --help: {got}"
