"""`stagemesh join GATEWAY_URL --token TOKEN --model FILE`: this host becomes a new stage of a running mesh; `stagemesh
leave`: a joined stage gives its layers back and exits (SIGTERM does the same).

The exchange (services/gateway/api/join.py is the other side): a one-use nonce from the gateway, answered with
HMAC-SHA256(token, "join|nonce|public key|sha256(report)") -- the token itself never crosses the link --; the gateway
answers with this stage's place (layers, its upstream's CURVE key, the next hop's address and key) under its own MAC
with the token, checked here before anything is used, so nobody between the two can swap a key or an address. The
CURVE key pair is made here, for this process only (no key directory is copied). The report carries this host's
measured ms per layer (decode steps of a probe of PROBE_LAYERS layers, as --split auto's calibration times them) and
the memory it has free, from which the gateway picks its layers."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

from services.process.args import add_config_args, add_model_args, later, parse_host_port
from services.process.keys import JOIN_TOKEN_ENV
from shared.config import StageConfig
from shared.cpu import usable_cores
from shared.errors import StagemeshError

log = logging.getLogger("stagemesh.join")

PROBE_LAYERS = 2  # layers loaded to time this host's cost per layer (then dropped)
PROBE_S = 0.3  # seconds of decode steps timed
READY_WAIT_S = 600.0  # the gateway answers /join/ready once the mesh routes through this stage


def register(sub) -> None:
    p = sub.add_parser("join", help="join a running mesh as a new stage (this host serves some of its layers)",
                       description="Prove the join token to the gateway at GATEWAY_URL, take the layers it gives "
                                   "this host, load them and serve as a new stage; SIGTERM (or `stagemesh leave`) "
                                   "gives them back before it exits.")
    p.add_argument("gateway", metavar="GATEWAY_URL", help="the gateway's HTTP address, e.g. http://10.0.0.2:8000")
    p.add_argument("--token", default=os.environ.get(JOIN_TOKEN_ENV),
                   help=f"the mesh's join token (the gateway's --join-token; default ${JOIN_TOKEN_ENV})")
    add_model_args(p, serving=True)  # --model, --dtype, --weights, --compile-decode, --batch-invariant, ...
    add_config_args(p, StageConfig)  # --kv-slots, --max-seq-len, --slot-lease, --threads
    p.add_argument("--listen", default="tcp://0.0.0.0:0",
                   help="ZeroMQ address to bind for input (port 0: the first free one; default tcp://0.0.0.0:0)")
    p.add_argument("--http", default="0.0.0.0:0", help="HOST:PORT for health, info and metrics (port 0: the first free "
                                                       "one; default 0.0.0.0:0)")
    p.add_argument("--advertise", default=None, metavar="HOST",
                   help="the address the gateway and the other stages reach this host at (default: the one this "
                        "host reaches the gateway from)")
    p.add_argument("--as", dest="join_as", choices=["stage", "replica"], default=None,
                   help="stage: join as a new stage even if the gateway predicts no gain; replica: serve a range the "
                        "mesh has, beside its process (the slowest after the first); default: the gateway's "
                        "prediction picks")
    p.add_argument("--insecure-plaintext", action="store_true",
                   help="no CURVE key (only for a gateway started with --insecure-plaintext)")
    p.set_defaults(func=later("services.cli.join:cmd_join", check=_check))

    p = sub.add_parser("leave", help="a joined stage gives its layers back to the mesh and exits",
                       description="Send SIGTERM to a `stagemesh join` process of this user (--pid, or the only "
                                   "one running) and wait until it has given its layers back and exited.")
    p.add_argument("--pid", type=int, default=None, help="the join process (default: the only one of this user)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for it (default 300)")
    p.set_defaults(func=cmd_leave)


def _check(args) -> None:
    if not args.token:
        raise StagemeshError(f"give the mesh's join token: --token TOKEN (or ${JOIN_TOKEN_ENV})")
    u = urlparse(args.gateway)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise StagemeshError(f"GATEWAY_URL {args.gateway!r} must be the gateway's http:// address")
    parse_host_port(args.http, "--http")


# ---- the exchange ------------------------------------------------------------------------------------------------

def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "|".join(parts).encode(), hashlib.sha256).hexdigest()


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class Gateway:
    """The join endpoints of one gateway, under one token."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url.rstrip("/"), token

    def post(self, path: str, body: dict, timeout: float = 30.0) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                why = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = e.reason
            raise StagemeshError(f"the gateway refused ({e.code}): {why}") from None
        except (urllib.error.URLError, OSError) as e:
            raise StagemeshError(f"cannot reach the gateway at {self.url}: {getattr(e, 'reason', e)}") from None

    def nonce(self) -> str:
        return self.post("/join/hello", {})["nonce"]

    def checked(self, nonce: str, answer: dict) -> dict:
        """The answer when its MAC is the token's over it; else why not (someone between changed it)."""
        body = {k: v for k, v in answer.items() if k != "mac"}
        want = _mac(self.token, "answer", nonce, _canonical(body))
        if not hmac.compare_digest(str(answer.get("mac", "")), want):
            raise StagemeshError("the gateway's answer does not carry the join token's MAC: something between this "
                                 "host and the gateway changed it (or it is not the gateway): nothing was used")
        return body

    def join(self, key: str | None, report: dict, join_as: str | None) -> dict:
        nonce = self.nonce()
        body = {"nonce": nonce, "key": key, "report": report,
                "proof": _mac(self.token, "join", nonce, key or "", hashlib.sha256(_canonical(report).encode())
                              .hexdigest())}
        if join_as:
            body["as"] = join_as
        return self.checked(nonce, self.post("/join", body))

    def proven(self, what: str, join_id: str, timeout: float) -> dict:
        nonce = self.nonce()
        return self.checked(nonce, self.post(f"/join/{what}", {"id": join_id, "nonce": nonce,
                                                               "proof": _mac(self.token, what, join_id, nonce)},
                                             timeout))


def advertise_host(gateway_url: str) -> str:
    """The address of this host on the route to the gateway (a UDP socket's local end: nothing is sent)."""
    u = urlparse(gateway_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((u.hostname, u.port or 80))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("*",) else "0.0.0.0", 0))
        return s.getsockname()[1]


# ---- the command --------------------------------------------------------------------------------------------------

def cmd_join(args) -> int:
    import asyncio

    import torch
    import zmq

    from services.process.args import config_from_args
    from services.stage.main import StagePlace, serve
    from shared.config import LoadConfig, check_address
    from shared.files.layers import LayerRange
    from shared.models.device import default_device, resolve_dtype
    from shared.runtime.model_files import ModelFiles
    from shared.wire.mesh_keys import KeyPair, SocketKeys

    config = config_from_args(StageConfig, args)
    load = config_from_args(LoadConfig, args)
    torch.set_num_threads(config.threads or usable_cores())
    t_exec = time.perf_counter()
    files = ModelFiles.open(args.model)
    host = args.advertise or advertise_host(args.gateway)
    scheme, _, rest = check_address(args.listen, "--listen").partition("://")
    bind_host, _, port = rest.rpartition(":")
    port = int(port) if port.isdigit() and int(port) else _free_port(bind_host)
    listen = f"{scheme}://{bind_host}:{port}"
    http_host, http_port = parse_host_port(args.http, "--http")
    http_port = http_port or _free_port(http_host)
    reach_host = host if bind_host in ("*", "0.0.0.0") else bind_host
    url = f"http://{host if http_host in ('0.0.0.0', '') else http_host}:{http_port}"
    device = default_device()
    dtype = resolve_dtype(load.dtype, device)
    report = probe_report(files, dtype, device, config, load)
    report.update(url=url, address=f"{scheme}://{reach_host}:{port}")
    pair = None if args.insecure_plaintext else KeyPair(*zmq.curve_keypair())
    gw = Gateway(args.gateway, args.token)
    place = gw.join(pair.public.decode() if pair else None, report, args.join_as)
    layers = LayerRange(*place["layers"])
    print(f"stagemesh join: placed at {place['place']} with layers {layers} (predicted "
          f"{place['predicted_gain']:.2f}x); loading", flush=True)
    keys = None
    if pair is not None:
        keys = SocketKeys(pair, place["upstream_key"].encode(), "the upstream member", pair,
                          place["next"]["key"].encode(), "the next member")
    stage_place = StagePlace(listen, place["next"]["address"], http_host, http_port, None, prefetch=True, tracing=True,
                             exit_with_parent=None, otlp_endpoint=None)
    joined = {}

    async def on_ready(worker, stop: asyncio.Event) -> None:
        if keys is not None and place.get("upstream_before_key"):  # a vanished upstream is routed around
            worker.io.transport.accept_from(keys.accept, (place["upstream_before_key"].encode(),),
                                            "the upstream member")
        try:
            answer = await asyncio.to_thread(gw.proven, "ready", place["id"], READY_WAIT_S)
        except StagemeshError as e:
            print(f"stagemesh join: error: {e}", flush=True)
            joined["error"] = str(e)
            stop.set()
            return
        joined.update(answer)
        role = f"a replica of stage {answer['place']}" if place.get("replica") else f"stage {answer['place']}"
        print(f"stagemesh join: serving layers {layers} as {role} of {answer['stages']} "
              f"({time.perf_counter() - t_exec:.1f} s after start; the mesh paused {answer['pause_s'] * 1e3:.0f} ms)",
              flush=True)

    async def on_stop() -> None:
        if "id" not in joined:
            return
        print("stagemesh join: leaving: giving layers back", flush=True)
        try:
            answer = await asyncio.to_thread(gw.proven, "leave", place["id"], READY_WAIT_S)
            print(f"stagemesh join: left; the mesh serves {answer['stages']} stages", flush=True)
        except StagemeshError as e:
            print(f"stagemesh join: leaving failed ({e}); exiting anyway", flush=True)

    # it serves the mesh's context (the joiner's own would do as well, the pipeline serving the least, but the same
    # context picks the same rope factors: a LongRoPE model's depend on it)
    mesh_context = place.get("max_seq_len")
    if isinstance(mesh_context, int) and not isinstance(mesh_context, bool) and mesh_context >= 16:
        config = dataclasses.replace(config, max_seq_len=mesh_context)
    asyncio.run(serve(files, layers, stage_place, config, load, keys, on_ready=on_ready, on_stop=on_stop))
    if "error" in joined:
        raise StagemeshError(joined["error"])
    return 0


def probe_report(files, dtype, device, config, load) -> dict:
    """What the gateway places this host by: its model, numerics (dtype, weights mode) and context, and its measured
    cost per layer, the cores it measured that on and its free memory (a probe of PROBE_LAYERS middle layers, loaded,
    timed at one row a step, dropped)."""
    import torch

    from shared.cpu import busy_cores, cpu_limit
    from shared.files.layers import LayerRange
    from shared.models.memory import available_bytes
    from shared.runtime.calibrate import calibrate
    from shared.runtime.stage_runtime import StageRuntime

    n = files.config.num_layers
    a = max(1, n // 2 - PROBE_LAYERS // 2)
    probe_range = LayerRange(a, min(n - 1, a + PROBE_LAYERS))
    probe = StageRuntime.load(files.loader, probe_range, dtype, device, config.kv_slots, config.max_seq_len,
                              weights=load.weights_mode, batch_invariant=load.batch_invariant, compile_decode="off",
                              kv_dtype=load.kv_dtype)
    timed = calibrate(probe, [1], PROBE_S, bandwidth=False)  # (placement reads its time alone)
    layers = len(probe_range)
    # a layer's weights and its K/V of one sequence of the whole context (what a stage promises to hold: the rows
    # beyond take memory only as they are written, within its admission bound)
    per_layer = (probe.model.weight_bytes() + probe.kv.position_bytes * probe.kv.max_seq_len) / layers
    free = available_bytes()
    if load.memory_budget is not None:
        free = min(free, load.memory_budget)
    report = {"fingerprint": files.loader.fingerprint, "model": files.loader.model_name, "num_layers": n,
              "dtype": str(dtype).removeprefix("torch."), "batch_invariant": bool(load.batch_invariant),
              "kv_dtype": str(probe.model.kv_dtype).removeprefix("torch."),
              "weights_mode": probe.model.weights,  # as its /info will say (StageInfo.weights_mode)
              "max_seq_len": probe.kv.max_seq_len, "kv_slots": probe.kv.num_slots,
              "ms_per_layer": round(timed["ms_per_step"][0] / layers, 4), "bytes_per_layer": int(per_layer),
              "free_bytes": int(free),
              # the cores the probe ran on: the gateway scales a stage's unmeasured cost by its cores against these
              "cores": round(busy_cores(torch.get_num_threads(), cpu_limit()), 4)}
    del probe
    return report


def _join_processes() -> list[int]:
    """This user's `stagemesh join` processes (from /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != os.getuid():
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"stagemesh") or a == b"services.cli" for a in argv) and b"join" in argv:
            found.append(int(name))
    return found


def cmd_leave(args: argparse.Namespace) -> int:
    pid = args.pid
    if pid is None:
        pids = _join_processes()
        if len(pids) != 1:
            raise StagemeshError(f"{'no' if not pids else len(pids)} `stagemesh join` processes of this user run "
                                 f"here{': ' + ', '.join(map(str, pids)) if pids else ''}; give --pid PID")
        pid = pids[0]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        raise StagemeshError(f"no process {pid}") from None
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"stagemesh leave: {pid} gave its layers back and exited")
            return 0
        time.sleep(0.2)
    raise StagemeshError(f"process {pid} did not exit within {args.timeout:g} s (it is still giving its layers back?)")
