"""Every benchmark script imports (a renamed helper must not leave a benchmark that no longer runs) and answers
--help without starting anything."""

import importlib
import pkgutil
import subprocess
import sys

import pytest

import benchmarks

MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))


def test_there_are_benchmarks():
    assert {"compare_llamacpp", "memory", "overlap", "trace_overhead"} <= set(MODULES)


@pytest.mark.processes
@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_module_imports(name):
    module = importlib.import_module(f"benchmarks.{name}")
    if hasattr(module, "main"):  # a script: its --help works as a command
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stderr[-2000:]
