"""The single-process CLI, run as a user would: real subprocesses on the real model."""

import json
import subprocess

import pytest

from tests.conftest import DATA, stagemesh_cmd, stagemesh_runs, starts_processes


def run(*args, timeout=300):
    proc = subprocess.run(stagemesh_cmd(*args), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def runs(*argvs: list[str]) -> list[str]:
    """Each command's stdout, the commands run in turn in one interpreter (tests.conftest.stagemesh_runs)."""
    answers = stagemesh_runs(*argvs)
    assert all(a["code"] == 0 for a in answers), [a["stderr"] for a in answers]
    return [a["stdout"] for a in answers]


@pytest.fixture(scope="module")
@starts_processes
def inspect_out() -> str:
    """`stagemesh inspect`'s output, run once for the tests that read it."""
    return run("inspect")


@pytest.mark.processes
@pytest.mark.parametrize("command", ["generate", "perplexity", "tokenize", "inspect"])
def test_help(command):
    assert "--model" in run(command, "--help")


@pytest.mark.processes
def test_generate_json_greedy_matches_llama_cpp_first_tokens(smollm2, llama_ref):
    """Greedy tokens of `generate` against llama.cpp's (its K/V cache float16, llama_ref's), with our K/V in float32
    and in float16 (--kv-dtype float16, the dtype llama.cpp keeps)."""
    argv = ["generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--dtype", "float32",
            "--temperature", "0", "--json"]
    out, half = (json.loads(o) for o in runs(argv, [*argv, "--kv-dtype", "float16"]))
    assert len(out["token_ids"]) == 8
    assert out["text"] == smollm2.tokenizer.decode(out["token_ids"])
    assert out["timings"]["generated_tokens"] == 8
    llama_ref.reset()
    prompt = llama_ref.tokenize(b"The capital of France is", add_bos=False)
    ref = []
    for tok in llama_ref.generate(prompt, temp=0.0, top_k=1):
        ref.append(tok)
        if len(ref) == 3:
            break
    assert out["token_ids"][:3] == ref  # the first greedy tokens agree with llama.cpp's
    assert half["token_ids"][:3] == ref


@pytest.mark.processes
def test_generate_chat_stops_at_eos_and_seed_is_reproducible():
    args = ["generate", "--chat", "--prompt", "Say hello.", "--json", "--dtype", "float32"]
    # the seeded draws: 16 tokens each, none of them EOS (at 40, each spent ~10 s more decoding to prove the same)
    sampled = ["--max-tokens", "16", "--temperature", "0.9", "--top-p", "0.95", "--top-k", "40", "--seed"]
    greedy, *draws = runs([*args, "--max-tokens", "40"], *([*args, *sampled, seed] for seed in ("7", "7", "8")))
    greedy = json.loads(greedy)
    assert greedy["token_ids"][-1] == 2 and len(greedy["token_ids"]) < 40  # <|im_end|> ends the turn
    seeded = [json.loads(d)["token_ids"] for d in draws]
    assert len(seeded[0]) == 16 and 2 not in seeded[0]  # a real draw, not cut short by the turn's end
    assert seeded[0] == seeded[1]  # a seed reproduces its draw...
    assert seeded[2] != seeded[0]  # ...and is what the draw depends on


@pytest.mark.processes
def test_perplexity_split_does_not_change_the_result(tmp_path):
    text = tmp_path / "varied-start.txt"  # its first 4200 characters: 1113 tokens, 8 chunks (the whole file: 12)
    with open(f"{DATA}/varied.txt", encoding="utf-8") as f:
        text.write_text(f.read()[:4200], encoding="utf-8")
    base = ["perplexity", "--file", str(text), "--context", "128", "--dtype", "float32", "--json"]
    whole, split = map(json.loads, runs(base, [*base, "--split", "7,19"]))
    assert whole["chunks"] >= 8 and whole["scored_tokens"] == whole["chunks"] * 63  # the second half of each chunk
    assert split == whole
    assert 5 < whole["perplexity"] < 40


@pytest.mark.processes
def test_tokenize_special_flag(smollm2):
    plain = json.loads(run("tokenize", "--json", "<|im_start|>hi"))["ids"]
    special = json.loads(run("tokenize", "--json", "--special", "<|im_start|>hi"))["ids"]
    assert special[0] == 1 and 1 not in plain
    assert plain == smollm2.tokenizer.encode("<|im_start|>hi")


@pytest.mark.processes
def test_inspect_describes_the_model(inspect_out):
    from shared.models.linear import qdot_takes

    out = inspect_out
    kernel = "q4_1-dot-q8" if qdot_takes("Q4_1") else "int4-g32"  # the integer-dot kernels on AVX2 CPUs
    for needle in ("llama", "30", "576", "Q4_1", "gpt2", "smollm", "im_start", "layers 0-29", f"attn_q Q4_1 -> {kernel}"):
        assert needle in out


@pytest.mark.processes
def test_bad_flags_are_clear_errors(tmp_path):
    proc = subprocess.run(stagemesh_cmd("generate", "--prompt", "x", "--top-p", "0"), capture_output=True, text=True)
    assert proc.returncode == 2 and "top_p" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(stagemesh_cmd("perplexity", "--file", "/nonexistent"), capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    short = tmp_path / "short.txt"
    short.write_text("Too short a text for two chunks of 256 tokens.")
    proc = subprocess.run(stagemesh_cmd("perplexity", "--file", str(short)), capture_output=True, text=True)
    assert proc.returncode == 2 and "2 x 256 = 512" in proc.stderr and "lower --context" in proc.stderr


@pytest.mark.parametrize("flags,expected", [
    ([], "auto"),  # --dtype left to its default: the fast kernels, whatever the CPU's default activation dtype
    (["--dtype", "float32"], "f32"),  # an explicit float32: the exact reference
    (["--dtype", "bfloat16"], "auto"),
    (["--dtype", "float32", "--weights", "lean"], "lean"),
])
def test_weights_mode_follows_the_dtype_flag(flags, expected):
    import argparse

    import torch

    from services.process.args import add_model_args, config_from_args
    from shared.config import LoadConfig
    from shared.models.device import resolve_dtype
    from shared.models.transformer import resolve_weights

    p = argparse.ArgumentParser()
    add_model_args(p)
    load = config_from_args(LoadConfig, p.parse_args(flags))
    assert resolve_weights(load.weights_mode, resolve_dtype(load.dtype, torch.device("cpu"))) == expected


@pytest.mark.processes
def test_inspect_reports_the_serving_default(inspect_out):
    assert "runs as (auto)" in inspect_out


@pytest.mark.parametrize("serving,env,flags,expected", [
    (True, None, [], "auto"),  # stage / up: compile in the background by default
    (True, "off", [], "off"),  # STAGEMESH_COMPILE_DECODE sets a serving command's default (the suite's is off)
    (True, "off", ["--compile-decode"], "on"),  # the flag alone: compile before ready, as before
    (True, None, ["--compile-decode", "off"], "off"),
    (False, None, [], "off"),  # generate / perplexity: a one-off run would spend itself compiling
])
def test_compile_decode_mode_follows_command_env_and_flag(monkeypatch, serving, env, flags, expected):
    import argparse

    from services.process.args import add_model_args, config_argv, config_from_args
    from shared.config import COMPILE_DECODE_ENV, LoadConfig

    if env is None:
        monkeypatch.delenv(COMPILE_DECODE_ENV, raising=False)
    else:
        monkeypatch.setenv(COMPILE_DECODE_ENV, env)
    p = argparse.ArgumentParser()
    add_model_args(p, serving=serving)
    args = p.parse_args(flags)
    assert args.compile_decode == expected
    assert config_argv(config_from_args(LoadConfig, args))[-2:] == ["--compile-decode", expected]  # what `up` hands its stages


def test_a_bad_compile_decode_default_is_a_clear_error(monkeypatch):
    import argparse

    from services.process.args import add_model_args
    from shared.config import COMPILE_DECODE_ENV
    from shared.errors import StagemeshError

    monkeypatch.setenv(COMPILE_DECODE_ENV, "sometimes")
    with pytest.raises(StagemeshError, match="STAGEMESH_COMPILE_DECODE='sometimes' must be one of auto, on, off"):
        add_model_args(argparse.ArgumentParser(), serving=True)
