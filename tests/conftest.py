import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from shared.runtime.model_files import ModelFiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")

# Stages the suite starts (dozens of them, each a real process) decode eagerly unless a test asks otherwise: with the
# serving default (auto) each would spend a minute of both cores compiling in the background. The compiled step is
# tested where it is the point: tests/test_numerics.py (in process) and tests/test_compiled_mesh.py (real stages).
os.environ["STAGEMESH_COMPILE_DECODE"] = "off"
# Nor do they read or write saved compiled decode steps (AOTInductor packages, by default under ~/.cache/stagemesh):
# where a stage compiles, its one-sequence step is torch.compile's, as the tests of it expect. tests/test_aoti_decode.py
# builds and loads packages in folders of its own.
os.environ["STAGEMESH_AOTI_CACHE"] = "off"
# The gateways' durable request logs (default: the user's data directory, one per port) go to a folder of the run's
# own, not the home directory of whoever runs the suite.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="stagemesh-test-data-")


def lazy_import(name: str):
    """The module `name`, run at its first attribute access (importlib's LazyLoader): the SDKs take seconds to import
    (anthropic 2 s, openai 1 s on 2 cores) and the unit tier collects the modules that use them without running a test
    that does."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def uses_llama_cpp(fixture_fn):
    """Tags a fixture function (under @pytest.fixture) as one that needs llama.cpp's Python binding (the reference)."""
    fixture_fn.uses_llama_cpp = True
    return fixture_fn


@pytest.fixture(scope="session")
def smollm2() -> ModelFiles:
    return ModelFiles.open("smollm2")


@pytest.fixture(scope="session")
@uses_llama_cpp
def llama_ref(smollm2):
    from services.testing.tiny_gguf import llama_cpp_model

    return llama_cpp_model(smollm2.loader.path, n_ctx=256)


@pytest.fixture
def without_integer_dot(monkeypatch):
    """This process loads weights as a CPU without the integer-dot kernels does (AVX512, or no compiler): Q4_0 / Q4_1
    / Q8_0 on int4, with auto's dense prefill copy and its measured crossover. Where the kernels do not run anyway,
    nothing changes."""
    from shared.kernels import qdot

    monkeypatch.setattr(qdot, "why_not", lambda: "turned off by the test (the int4 path)")


@pytest.fixture(scope="session")
def varied_text() -> str:
    with open(os.path.join(DATA, "varied.txt"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="session")
def output_dir() -> str:
    path = os.path.join(ROOT, "test-output")
    os.makedirs(path, exist_ok=True)
    return path


def stagemesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


_CLI_RUNS = """
import contextlib, io, json, sys
from services.cli.main import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    torch_before = "torch" in sys.modules
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps({"code": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue()[-4000:],
                      "torch": "torch" in sys.modules and not torch_before}), flush=True)
"""


def stagemesh_runs(*argvs: list[str], timeout: float = 600) -> list[dict]:
    """Several `stagemesh` commands run in turn in one fresh interpreter (as many processes' imports cost seconds
    each on 2 cores): each one's {"code", "stdout", "stderr", "torch" (it loaded torch)}. Each command's main() runs
    from its arguments as the CLI does; what one leaves in the interpreter (imports, caches) the next finds."""
    import json

    p = subprocess.run([sys.executable, "-c", _CLI_RUNS, json.dumps([list(a) for a in argvs])], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)
    answers = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == len(argvs), (p.stdout[-2000:], p.stderr[-3000:])
    return answers


# ---- the `processes` tier ------------------------------------------------------------------------------------------
# A test that starts real processes (a stagemesh CLI run, a stage, a mesh, a gateway, `up`, llama-server, Chromium,
# network namespaces) is marked `processes`: `pytest -m "not processes"` is the fast tier. A fixture that starts them
# is tagged with @starts_processes and marks every test that uses it, directly or through another fixture; a test
# that starts them inline carries the mark itself. The guard below makes the mark a checked fact: in a test without
# it, starting such a process is an error that names the test.

def starts_processes(fixture_fn):
    """Tags a fixture function (put it under @pytest.fixture) as one that starts real processes."""
    fixture_fn.starts_processes = True
    return fixture_fn


def pytest_collection_modifyitems(config, items):  # before -m deselects by these marks (a conftest's hook runs first)
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for name in getattr(info, "names_closure", ()) for d in info.name2fixturedefs.get(name, ())]
        if any(getattr(d.func, "starts_processes", False) for d in defs):
            item.add_marker(pytest.mark.processes)
        if any(getattr(d.func, "uses_llama_cpp", False) for d in defs):
            item.add_marker(pytest.mark.reference)
    items[:] = order_by_shared_up(items)


# ---- the suite in two parts at once (make test) ------------------------------------------------------------------
# On 2 cores the tests that start processes wait part of the time (for stages to load, for a stream, for a kill to be
# noticed), and the modules that start none are CPU-bound: `make test` runs the two parts as two pytest sessions side
# by side, the CPU-bound one at a lower priority, and the cores are busy throughout (2 % idle over a whole suite,
# 2026-12-03: the processes part and its stages took ~2/3 of the CPU, the other part the rest). A module goes whole
# to one part (its module fixtures are set up once): to "processes" if any of its tests that run starts one (unless
# marked cpu_bound: a process that only computes, which waits on nothing) or bounds a time; the others to the
# in-process part, or where no test starts processes (the unit tier), heaviest first to the part with less work so far
# (by the tests' recorded times, tests/durations.json). A test that bounds a time (a gap, how soon a loss is noticed,
# how much traffic a window saw) is marked `timing`: the processes part runs those last,
# each only once the other part has ended ($STAGEMESH_SUITE_PARTNER, its pid), so nothing else shares the cores with
# it; the other tests of their modules run before that wait, unless they share a module fixture with a timing test.

def pytest_addoption(parser):
    parser.addoption("--part", choices=("in-process", "processes"), default=None,
                     help="run one part of the suite: the modules none of whose tests starts a process (in-process), "
                          "or the others (processes), their `timing` tests last (make test runs both at once)")


class _SuitePart:
    """Keeps one part's items, after -m has deselected (trylast: after the mark plugin's own hook)."""

    def __init__(self, part: str):
        self.part = part

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        from tests.durations import recorded

        kept = suite_part(items, self.part, recorded())
        mine = set(kept)
        config.hook.pytest_deselected(items=[item for item in items if item not in mine])
        items[:] = kept


def pytest_configure(config):
    part = config.getoption("--part", None)
    if part is not None:
        config.pluginmanager.register(_SuitePart(part), "stagemesh-suite-part")


def suite_part(items: list[pytest.Item], part: str, seconds: dict[str, float]) -> list[pytest.Item]:
    """The items of one part, in the order they run. A module is in the processes part when any of its items is
    marked processes (but not cpu_bound: its processes only compute) or timing. Where some start processes (the
    whole suite) every other module is in the in-process part; where none does (the unit tier) the others, heaviest
    first
    by `seconds` (a test's recorded time; none: 5 s for one marked processes, 0.1 s for another), go each to the part
    with fewer seconds so far (ties: in-process), the processes part's counted without what runs after the other
    part has ended (below). Each module keeps its order. In the processes part the modules with `timing` tests come last,
    their other tests first (each module's in its order), then those that wait for the other part to end: the
    `timing` ones and those that share a module fixture with one (set up once). Both sessions of a run compute the
    same split from the same items."""
    def module(item):
        return item.nodeid.split("::")[0]

    def recorded(item):  # a test not yet timed: as a typical one of its kind
        return seconds.get(item.nodeid, 5.0 if item.get_closest_marker("processes") is not None else 0.1)

    timing = [item for item in items if item.get_closest_marker("timing") is not None]
    timed = {module(item) for item in timing}
    timing_fixtures: dict[str, set[str]] = {}  # module -> the module fixtures its timing tests use
    for t in timing:
        timing_fixtures.setdefault(module(t), set()).update(_module_fixtures(t))
    late = set(timing) | {item for item in items  # run once the other part has ended
                          if _module_fixtures(item) & timing_fixtures.get(module(item), set())}
    weight: dict[str, float] = {}
    for item in items:
        weight[module(item)] = weight.get(module(item), 0.0) + (0.0 if item in late else recorded(item))
    waits = {module(item) for item in items if item.get_closest_marker("processes") is not None
             and item.get_closest_marker("cpu_bound") is None}
    pinned = timed | waits
    load = {"processes": sum(weight[m] for m in pinned), "in-process": 0.0}
    where = dict.fromkeys(pinned, "processes")
    for m in sorted(set(weight) - pinned, key=lambda m: (-weight[m], m)):
        # beside tests that start processes, every CPU-bound module runs in the other part, at the lower priority:
        # one in the processes part would take the cores from it rather than the idle time (it ran 2.5x slower)
        where[m] = "processes" if not waits and load["processes"] < load["in-process"] else "in-process"
        load[where[m]] += weight[m]
    mine = [item for item in items if where[module(item)] == part]
    if part == "in-process":
        return mine
    return ([item for item in mine if module(item) not in timed]
            + [item for item in mine if module(item) in timed and item not in late]
            + [item for item in mine if item in late])


def _module_fixtures(item: pytest.Item) -> set[str]:
    """The fixtures of `item` set up once for its module or class (a test run apart from the others of its module
    would set them up a second time)."""
    info = getattr(item, "_fixtureinfo", None)
    return {name for name in getattr(info, "names_closure", ())
            for d in info.name2fixturedefs.get(name, ()) if d.scope in ("module", "class", "package")}


def _wait_for_partner(item: pytest.Item) -> None:
    """Before a `timing` test: wait until the suite's other part ($STAGEMESH_SUITE_PARTNER, a pid) has exited."""
    pid = int(os.environ.get("STAGEMESH_SUITE_PARTNER") or 0)
    if pid <= 0 or item.get_closest_marker("timing") is None:
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)


# ---- the `reference` tier ------------------------------------------------------------------------------------------
# A test that needs llama.cpp (llama-cpp-python, built ~6 min, or its vendored sources) is marked `reference`, through a
# fixture tagged @uses_llama_cpp or on the test itself; `make test-unit` runs without it. The guard makes the mark a
# checked fact: a test without it that imports llama_cpp fails, naming the test.

class _LlamaCppGuard:
    """A meta path finder that refuses `import llama_cpp` inside a running test that is not marked reference."""

    def find_spec(self, name, path=None, target=None):
        item = _running[-1] if _running else None
        if name.split(".")[0] == "llama_cpp" and item is not None and item.get_closest_marker("reference") is None:
            raise ImportError(f"{item.nodeid} imports llama_cpp but is not marked reference: tag the fixture with "
                              "@uses_llama_cpp or mark the test @pytest.mark.reference")
        return None


sys.meta_path.insert(0, _LlamaCppGuard())


PROGRAMS = ("stagemesh", "chromium", "llama-server")  # what a command line starts: one of ours, or python -m
MODULES = ("services.", "benchmarks.")  # services.cli, benchmarks.x, ...; or `ip netns`


def _starts_ours(args) -> bool:
    words = os.fsdecode(args).split() if isinstance(args, (str, bytes, os.PathLike)) else [os.fsdecode(a) for a in args]
    modules = [m for flag, m in zip(words, words[1:]) if flag == "-m"]
    return (bool(words) and os.path.basename(words[0]) in PROGRAMS) or any(m.startswith(MODULES) for m in modules) \
        or "netns" in words


_running: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _wait_for_partner(item)
    _running.append(item)  # its module's fixtures are set up and torn down inside this call too
    try:
        return (yield)
    finally:
        _running.pop()


class _GuardedPopen(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        item = _running[-1] if _running else None
        if item is not None and item.get_closest_marker("processes") is None and _starts_ours(args):
            raise RuntimeError(f"{item.nodeid} starts {str(args)[:160]} but is not marked processes: tag the "
                               "fixture with @starts_processes or mark the test @pytest.mark.processes")
        super().__init__(args, *rest, **kwargs)


subprocess.Popen = _GuardedPopen  # subprocess.run, asyncio's subprocesses and os.popen all create one


# ---- one `stagemesh up` per setup, shared by the session --------------------------------------------------------
# Most tests only send requests to a gateway: those ask the `up` fixture for one and share it with every other test,
# in any module, that asks for the same setup (stages, dtype, flags, API key). A test that disturbs its gateway (kills
# or stops a stage, drains it, needs the process environment at start-up or counters no other test moved) starts a
# private one with services.testing.harness.start_up instead and stops it itself.

LIVE_UPS = 2  # shared ups kept running at once (each holds its stages' weights and KV, 1-2 GB): asking for one more
# stops the one asked for least recently, so a module may use at most this many setups at a time


@pytest.fixture(scope="session")
@starts_processes
def up(tmp_path_factory):
    """up(*flags, stages=1, dtype=None, api_key=None) -> the RunningGateway of `stagemesh up --stages N [--dtype D]
    FLAGS` (dtype None: up's own default), with STAGEMESH_API_KEY=api_key in its environment when given. Started the
    first time the session asks for that setup and ready; later asks get the same one back, checked to be still
    serving (a test that left it dead or not ready fails the next user with a message saying so). All are stopped
    at the session's end."""
    from services.testing.harness import RunningGateway, start_up

    running: dict[tuple, RunningGateway] = {}  # setup -> its gateway, least recently asked for first

    def get(*flags: str, stages: int = 1, dtype: str | None = None, api_key: str | None = None) -> RunningGateway:
        setup = (stages, dtype, flags, api_key)
        gw = running.pop(setup, None)
        if gw is not None:
            status = "exited" if gw.proc.poll() is not None else f"/ready {gw.get('/ready')[0]}"
            if status != "/ready 200":
                raise RuntimeError(f"the shared up {setup} is no longer serving ({status}; log {gw.log_path}): a test "
                                   "that disturbs its gateway must start its own with start_up")
            running[setup] = gw
            return gw
        while len(running) >= LIVE_UPS:
            running.pop(next(iter(running))).stop()
        saved = os.environ.get("STAGEMESH_API_KEY")
        if api_key is not None:
            os.environ["STAGEMESH_API_KEY"] = api_key  # the up process inherits it: its gateway runs in API key mode
        try:
            gw = start_up(stages, dtype, str(tmp_path_factory.mktemp(f"up{stages}")), *flags)
        finally:
            if saved is None:
                os.environ.pop("STAGEMESH_API_KEY", None)
            else:
                os.environ["STAGEMESH_API_KEY"] = saved
        running[setup] = gw
        return gw

    yield get
    for gw in running.values():
        gw.stop()


def shares_up(fixture_fn):
    """Tags a fixture function (put it under @pytest.fixture) that returns one of the `up` fixture's shared gateways:
    the suite runs the tests that use it one after the other (order_by_shared_up). It starts processes."""
    fixture_fn.shares_up = True
    fixture_fn.starts_processes = True
    return fixture_fn


def _setups(item: pytest.Item) -> frozenset:
    """The shared ups an item's fixtures ask for: (where the fixture is defined, its name, its parameter) of each
    fixture tagged @shares_up in its closure."""
    info = getattr(item, "_fixtureinfo", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    found = set()
    for name in getattr(info, "names_closure", ()):
        defs = info.name2fixturedefs.get(name, ())
        if defs and getattr(defs[-1].func, "shares_up", False):  # the last definition is the one in force
            found.add((defs[-1].baseid, name, repr(params.get(name))))
    return frozenset(found)


def order_by_shared_up(items: list[pytest.Item]) -> list[pytest.Item]:
    """The collected tests in an order that starts each shared up as few times as LIVE_UPS allows. A module's tests
    stay together (its module fixtures are set up once). After a module, the next is the first in collected order
    among those that ask for an up still running, fewest new ups first; else the next in collected order. Inside a
    module, the places of the tests on shared ups are filled with the groups of the ups still running first, the
    other groups after them in collected order; every other test keeps its place."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    setups = {m: frozenset().union(*map(_setups, its)) for m, its in modules.items()}
    live: list = []  # the ups the session would still run, least recently asked for first (as `up` keeps them)
    ordered, remaining = [], list(modules)
    while remaining:
        reusing = [m for m in remaining if setups[m] & set(live)]
        m = min(reusing, key=lambda m: len(setups[m] - set(live))) if reusing else remaining[0]
        remaining.remove(m)
        groups: dict[frozenset, list[pytest.Item]] = {}
        for item in modules[m]:
            if _setups(item):
                groups.setdefault(_setups(item), []).append(item)
        in_order = sorted(groups, key=lambda g: not g & set(live))  # stable: collected order otherwise
        for g in in_order:
            for setup in sorted(g):
                if setup in live:
                    live.remove(setup)
                live.append(setup)
                del live[:-LIVE_UPS]
        refill = iter([item for g in in_order for item in groups[g]])
        ordered += [next(refill) if _setups(item) else item for item in modules[m]]
    return ordered


# ---- setups several modules share (one place each: a module that uses one asks for it by name) -----------------------

DEFAULT_MAX_TOKENS = 6  # smollm2_gateway's --default-max-tokens (test_openai_api's CAP)


@pytest.fixture(scope="module")
@shares_up
def smollm2_gateway(up):
    """`up` of 1 stage, SmolLM2, with --default-max-tokens DEFAULT_MAX_TOKENS and no API key: the OpenAI, Responses
    and Anthropic surfaces' SDK tests (test_openai_api, test_responses_api, test_anthropic_api)."""
    return up("--default-max-tokens", str(DEFAULT_MAX_TOKENS))


@pytest.fixture
def openai_client(smollm2_gateway):
    import openai

    return openai.OpenAI(base_url=smollm2_gateway.url + "/v1", api_key="unused", max_retries=0)


EDGE_KEY = "k3y-for-tests"  # edge's API key
EDGE_ORIGIN = "http://good.example"  # the foreign origin edge allows
EDGE_KEEPALIVE_S = 2.0


@pytest.fixture(scope="module")
@shares_up
def edge(up):
    """A gateway (1 stage, float32) with an API key (EDGE_KEY), one allowed foreign origin, two allowed Host names
    (one a domain), /metrics behind the key and a 2 s keep-alive: test_gateway_edge, and test_anthropic_api's key
    tests."""
    return up("--allow-origin", EDGE_ORIGIN, "--metrics-require-key", "--keepalive-timeout", str(EDGE_KEEPALIVE_S),
              "--allow-host", "good.example", "--allow-host", ".corp.example", dtype="float32", api_key=EDGE_KEY)


@pytest.fixture(scope="module")
@shares_up
def gemma_gateway(up):
    """`up` of the real Gemma 3 270M file (1 stage; its GGUF has no chat template) served as "gemma-small": the SDK
    (test_openai_api) and the page (test_browser) chat with it. Its tests are marked reference: the file comes with
    the reference packages."""
    return up("--model", "gemma3-270m", "--served-model-name", "gemma-small")


@pytest.fixture(scope="module")
@shares_up
def serve_gateway(up):
    """`make serve`'s setup: 2 stages, up's defaults (test_loadtest, test_readme_examples)."""
    return up(stages=2)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    """A tiny llama GGUF (services.testing.tiny_gguf), written once for the session; tests only read it."""
    from services.testing.tiny_gguf import TinySpec, write_tiny_gguf

    return write_tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"), TinySpec(arch="llama"))


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
@starts_processes
def chromium():
    """A headless Chromium of its own (a fresh profile), its DevTools port (test_browser, test_mesh_view)."""
    from services.testing.harness import free_port

    assert os.path.exists(CHROMIUM), "chromium is missing: `make test` installs Debian's chromium package"
    port = free_port()
    profile = tempfile.mkdtemp(prefix="chromium-")
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={profile}", f"--remote-debugging-port={port}", "--window-size=900,700",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield port
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(profile, ignore_errors=True)


torch.set_num_threads(max(1, os.cpu_count() or 1))


def greedy_step(pipe, seqs: dict[str, list[int]], done: dict[str, int]):
    """One micro-batch of the sequences (a prompt not yet `done` in full, else a decode of its last token): (greedy
    next tokens, logits)."""
    from shared.batch.sampling import SamplingParams
    from shared.batch.steps import Decode, Prefill
    from shared.wire.protocol import SeqEntry

    work, ids = [], []
    for seq_id, tokens in seqs.items():
        if seq_id not in done:
            work.append(SeqEntry(seq_id, Prefill(len(tokens), 0, len(tokens), True), SamplingParams()))
            ids += tokens
        else:
            work.append(SeqEntry(seq_id, Decode(len(tokens) - 1), SamplingParams()))
            ids.append(tokens[-1])
    logits = pipe.run(work, torch.tensor(ids))
    return {w.seq_id: int(row.argmax()) for w, row in zip(work, logits)}, logits
