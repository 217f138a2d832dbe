"""Hosts on one machine for what crosses a network: one network namespace per host on a bridge, a relay in front of
every host's ports that adds a one-way delay (this kernel has no `tc netem`), and `tc tbf` to cap each host's link
bandwidth. tests/test_netns.py rehearses the Kubernetes deployment on it; benchmarks/links.py measures what a
shaped link costs. Needs root (`ip netns add`); netns_permitted() says why not where it cannot run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def netns_permitted() -> str | None:
    """None where namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "iproute2 (ip) is not installed"
    probe = sh("ip", "netns", "add", "smprobe", check=False)
    if probe.returncode != 0:
        return f"ip netns add is not permitted here: {probe.stderr.strip()}"
    sh("ip", "netns", "del", "smprobe", check=False)
    return None


class DelayRelay:
    """A TCP relay listen -> target that holds every chunk `delay` seconds in each direction, order kept. Threads,
    not an event loop: time.sleep wakes within ~0.1 ms, where an epoll timeout rounds up to whole milliseconds (a
    0.5 ms delay would be 1 ms). The delay may change while it runs."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: float = 0.0):
        self.listen, self.target, self.delay = listen, target, delay
        self._server = socket.create_server(listen, reuse_port=False)
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        """Two threads a direction: one reads and stamps each chunk with its due time, one sends it when due."""
        chunks: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()

        def read() -> None:
            try:
                while data := src.recv(1 << 16):
                    with ready:
                        chunks.append((time.monotonic() + self.delay, data))
                        ready.notify()
            except OSError:
                pass
            with ready:
                chunks.append((0.0, b""))
                ready.notify()

        def deliver() -> None:
            while True:
                with ready:
                    while not chunks:
                        ready.wait()
                    due, data = chunks.popleft()
                if not data:
                    break
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    break
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=deliver, daemon=True).start()


class Relays:
    """Every host's relays together: set_delay changes them all."""

    def __init__(self, relays: list[DelayRelay]):
        self.relays = relays

    def start(self) -> None:
        for r in self.relays:
            r.start()

    def set_delay(self, seconds: float) -> None:
        for r in self.relays:
            r.delay = seconds

    def stop(self) -> None:
        for r in self.relays:
            r.stop()


def namespaces(tag: str, subnet: str, hosts: dict[str, int], names: dict[str, str],
               ports: dict[str, list[int]]) -> Iterator[Relays]:
    """One network namespace per host (sm{tag}-HOST, address subnet.OCTET) on bridge br-sm{tag}test, each resolving
    every host's DNS name to the relay in front of it (subnet.OCTET+100, in this namespace); yields the relays,
    removes everything after. Raises RuntimeError where namespaces cannot be made (netns_permitted)."""
    reason = netns_permitted()
    if reason:
        raise RuntimeError(reason)
    bridge = f"br-sm{tag}test"
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    relays = None
    try:
        for host, octet in hosts.items():
            ns = f"sm{tag}-{host}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"v{tag}-{host}", "type", "veth", "peer", "name", f"p{tag}-{host}")
            sh("ip", "link", "set", f"v{tag}-{host}", "master", bridge, "up")
            sh("ip", "link", "set", f"p{tag}-{host}", "netns", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.{octet}/24", "dev", f"p{tag}-{host}")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", f"p{tag}-{host}", "up")
            sh("ip", "addr", "add", f"{subnet}.{octet + 100}/24", "dev", bridge)  # this host's relay address
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n")
                for other, o in hosts.items():
                    f.write(f"{subnet}.{o + 100} {names[other]}\n")
        relays = Relays([DelayRelay((f"{subnet}.{o + 100}", port), (f"{subnet}.{o}", port))
                         for host, o in hosts.items() for port in ports[host]])
        relays.start()
        yield relays
    finally:
        if relays:
            relays.stop()
        for host in hosts:
            sh("ip", "netns", "del", f"sm{tag}-{host}", check=False)
            shutil.rmtree(f"/etc/netns/sm{tag}-{host}", ignore_errors=True)
        sh("ip", "link", "del", bridge, check=False)


def shape_links(tag: str, hosts: list[str], rate: str | None) -> None:
    """Cap every host's link at `rate` (tc's units, e.g. "1gbit") both ways: tbf on the bridge side of its veth
    (traffic to the host) and on the host side (traffic from it). None removes the caps."""
    for host in hosts:
        for ns, dev in ((None, f"v{tag}-{host}"), (f"sm{tag}-{host}", f"p{tag}-{host}")):
            prefix = ("ip", "netns", "exec", ns) if ns else ()
            sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                # burst: ~1 ms at 1 Gbit/s (tbf needs at least rate/HZ); latency: how long a packet may queue
                sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "128kb",
                   "latency", "50ms")


def start_pods(tag: str, commands: dict[str, list[str]], url: str, log_dir: str, ready=lambda body: True,
               timeout: float = 240) -> Iterator[dict[str, subprocess.Popen]]:
    """Start each host's `stagemesh` command in its namespace; yields the processes once the gateway's /ready
    answers 200 and ready(body) holds (RuntimeError with the logs' tails if a process exits or time runs out);
    stops them all after."""
    cli = [sys.executable, "-m", "services.cli"]
    logs = {host: os.path.join(log_dir, f"{host}.log") for host in commands}
    procs = {host: subprocess.Popen(["ip", "netns", "exec", f"sm{tag}-{host}", *cli, *args],
                                    stdout=open(logs[host], "w"), stderr=subprocess.STDOUT)
             for host, args in commands.items()}

    def tails() -> dict[str, str]:
        return {h: open(p).read()[-800:] for h, p in logs.items()}

    deadline = time.monotonic() + timeout
    try:
        while True:
            if any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"a host's process exited: {tails()}")
            try:
                out = subprocess.run(["curl", "-sf", f"{url}/ready"], capture_output=True, text=True, timeout=5)
                if out.returncode == 0 and ready(json.loads(out.stdout)):
                    break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the deployment never became ready: {tails()}")
            time.sleep(1)
        yield procs
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
