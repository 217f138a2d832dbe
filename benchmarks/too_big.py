"""Too big for one host: a model served by 2 stages, each confined by a cgroup (v1 memory controller) to less memory
than the whole file, where one process under the same limit cannot load it.

    python -m services.testing.shaped_gguf llama3.1-8b Q4_K_M        # prints the file's path (built once)
    python -m benchmarks.too_big --model FILE [--limit 3.5G] [--out DIR]

The single process is
`stagemesh generate` in one cgroup: it must be refused before loading (DoesNotFit), not killed part way. The mesh is
`stagemesh up --stages 2 --weights lean --compile-decode off`, each stage moved into a cgroup of its own as soon as
it starts (while it imports, before it loads weights); it must serve a request. Each cgroup's peak usage and its failcnt (times
the limit was hit) are read back. Writes too_big.json and too_big.md into --out (default: a new
benchmarks/results/<date>-too-big). Needs root."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from services.testing.harness import add_out_arg, children, free_port, results_dir, write_results
from shared.config import parse_bytes

CGROUPS = "/sys/fs/cgroup/memory"
GiB = 2**30


def make_cgroup(name: str, limit: int) -> str:
    path = os.path.join(CGROUPS, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    try:  # a process moved in brings what it already holds (kernels that still have the knob)
        with open(os.path.join(path, "memory.move_charge_at_immigrate"), "w") as f:
            f.write("1")
    except OSError:
        pass
    return path


def read(path: str, key: str) -> int:
    with open(os.path.join(path, key)) as f:
        return int(f.read())


def join(cgroup: str, pid: int) -> None:
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid))


def one_process(model: str, limit: int) -> dict:
    cg = make_cgroup("stagemesh-too-big-one", limit)
    try:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", model, "--weights", "lean",
                              "--prompt", "Hello", "--max-tokens", "4"], capture_output=True, text=True, timeout=900,
                             preexec_fn=lambda: join(cg, os.getpid()))
        return {"returncode": out.returncode, "seconds": round(time.monotonic() - t0, 1),
                "said": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "",
                "peak_bytes": read(cg, "memory.max_usage_in_bytes"), "failcnt": read(cg, "memory.failcnt")}
    finally:
        os.rmdir(cg)


def two_stages(model: str, limit: int, logs: str) -> dict:
    cgs = [make_cgroup(f"stagemesh-too-big-s{i}", limit) for i in range(2)]
    port = free_port()
    t0 = time.monotonic()
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", model, "--stages", "2", "--port",
                           str(port), "--weights", "lean", "--compile-decode", "off", "--log-dir", logs],
                          stdout=open(os.path.join(logs, "up.log"), "w"), stderr=subprocess.STDOUT)
    try:
        stages: list[int] = []
        while len(stages) < 2 and time.monotonic() - t0 < 30:  # the stages start within a second of up
            stages = [p for p in children(up.pid) if "--stage-index" in open(f"/proc/{p}/cmdline").read()]
            time.sleep(0.02)
        for pid in stages:
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            join(cgs[int(argv[argv.index("--stage-index") + 1])], pid)
        url = f"http://127.0.0.1:{port}"
        while True:
            if up.poll() is not None:
                raise SystemExit(f"stagemesh up exited: {open(os.path.join(logs, 'up.log')).read()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        ready_s = time.monotonic() - t0
        body = json.dumps({"prompt": "Tell me about the sea.", "max_tokens": 32, "ignore_eos": True}).encode()
        t1 = time.monotonic()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.loads(r.read())
        seconds = time.monotonic() - t1
        return {"ready_s": round(ready_s, 1), "completion_tokens": answer["usage"]["completion_tokens"],
                "tokens_per_s": round(answer["usage"]["completion_tokens"] / seconds, 2),
                "stages": [{"peak_bytes": read(cg, "memory.max_usage_in_bytes"), "failcnt": read(cg, "memory.failcnt"),
                            "usage_bytes": read(cg, "memory.usage_in_bytes")} for cg in cgs]}
    finally:
        up.terminate()
        up.wait(60)
        time.sleep(1)
        for cg in cgs:
            os.rmdir(cg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF path (e.g. the 8B-shaped Q4_K_M of services.testing.shaped_gguf)")
    p.add_argument("--limit", default="3.5G", help="each process's memory limit (less than the whole file)")
    add_out_arg(p, "too-big")
    args = p.parse_args()
    if not os.access(CGROUPS, os.W_OK):
        sys.exit(f"benchmarks.too_big needs a writable cgroup v1 memory controller at {CGROUPS} (root)")
    model = args.model
    limit, file_bytes = parse_bytes(args.limit), os.path.getsize(model)
    if limit >= file_bytes:
        sys.exit(f"--limit {args.limit} is not less than the file ({file_bytes / GiB:.2f} GiB): nothing to show")
    out = results_dir(args.out, "too-big")
    with tempfile.TemporaryDirectory() as logs:
        single = one_process(model, limit)
        print("one process:", json.dumps(single), flush=True)
        mesh = two_stages(model, limit, logs)
        print("two stages:", json.dumps(mesh), flush=True)
    md = "\n".join([
        f"{os.path.basename(model)}: {file_bytes / GiB:.2f} GiB; every process limited to {limit / GiB:.2f} GiB "
        "(cgroup v1 memory.limit_in_bytes)", "",
        "| run | result | peak memory in its cgroup | limit hit (failcnt) |", "| --- | --- | --- | ---: |",
        f"| one process (`generate --weights lean`) | exit {single['returncode']} after {single['seconds']} s: "
        f"{single['said']} | {single['peak_bytes'] / GiB:.2f} GiB | {single['failcnt']} |",
        *(f"| stage {i} of `up --stages 2 --weights lean` | served {mesh['completion_tokens']} tokens at "
          f"{mesh['tokens_per_s']} tok/s, ready in {mesh['ready_s']} s | {s['peak_bytes'] / GiB:.2f} GiB | "
          f"{s['failcnt']} |" for i, s in enumerate(mesh["stages"]))])
    write_results(out, "too_big", {"model": model, "limit": limit, "file_bytes": file_bytes, "one_process": single,
                                   "two_stages": mesh}, md)
    print(md)


if __name__ == "__main__":
    main()
