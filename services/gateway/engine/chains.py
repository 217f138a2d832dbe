"""Replicas of a stage: a layer range served by several stage processes (instances), and the chain each sequence is
bound to (issue 68 item 3).

The pipeline's stages (Pipeline.stage_urls) are one instance per range: the *primary* chain. A replica of range i
(`stagemesh join --as replica`, services/gateway/engine/membership.py) is one more instance of it. A sequence's K/V for
range i lives on the one instance its first chunk went through, so at admission each sequence gets a chain -- one
instance per range after the first, the `route` its micro-batches carry (shared.wire.protocol.ForwardBatch.route) --
and keeps it while it runs; the scheduler forms micro-batches per chain. Choosing: per replicated range, the instance
with the least predicted work, (its sequences + 1) x its measured ms per micro-batch (the stage's /info: busy seconds
over micro-batches; unmeasured instances count as their range's primary). An instance that vanishes takes only the
sequences bound to it: they replay from their token histories on a chain of the living ones (Scheduler.instance_lost).

A mesh without replicas has no ChainTable entries beyond the primary: `replicated` is False, no route is chosen, no
micro-batch carries one -- the single chain is exactly today's pipeline. The first range has no replicas (the
gateway sends to one first stage).

A finished sequence kept as a cached prefix (services/gateway/engine/prefix_cache.py) is kept on its chain: a new
sequence attaches it only on that chain (Scheduler._lookup takes the prefix's chain while its predicted work is within
PREFIX_CHAIN_SLACK of the least loaded one's; past that it computes the prompt on the least loaded chain), and an
instance's loss forgets the prefixes kept on chains naming it.

A chain a stage can follow: an instance of range i sends to the instances of range i+1 it was told of (the "hops"
phase goes along the primary chain only), so a replica of a middle range sends to the next range's primary; a chain
through a replica of range i then takes the primary of every later range (`followable`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire.stage_info import StageInfo

PREFIX_CHAIN_SLACK = 1.5  # a new sequence goes to its cached prefix's chain unless that chain's predicted work is more
# than this times the least loaded one's (then it computes its prompt where the load is least)


@dataclass
class Instance:
    """One stage process serving a range."""

    id: str  # what a route names: its incarnation (a primary), or the gateway's name for it (a replica: r-<join id>)
    url: str  # its HTTP endpoint (/info)
    layers: tuple[int, int]
    address: str  # its input address, as its upstream reaches it
    key: str | None  # its CURVE public key (None: plaintext)
    primary: bool = False  # in Pipeline.stage_urls (else a replica)
    join_id: str | None = None  # a replica's join
    ms_per_mb: float | None = None  # measured: busy seconds over micro-batches computed, from its last /info
    bound: set[str] = field(default_factory=set)  # the running sequences whose chain names it
    incarnation: str = ""  # its process's, once it answered /info (a restart is a new process: a loss)

    def wire(self) -> dict:
        return {"id": self.id, "layers": list(self.layers), "address": self.address, "key": self.key}

    def view(self) -> dict:
        return {"id": self.id, "url": self.url, "layers": list(self.layers), "primary": self.primary,
                "join": self.join_id, "sequences": len(self.bound),
                "ms_per_micro_batch": None if self.ms_per_mb is None else round(self.ms_per_mb, 3)}


def ms_per_micro_batch(info: StageInfo) -> float | None:
    """A stage's measured busy milliseconds per micro-batch computed (None before its first)."""
    return 1e3 * info.busy_seconds / info.microbatches if info.microbatches else None


class ChainTable:
    """The instances of each range (`ranges[i]`: range i's, primary first) and which sequences each holds."""

    def __init__(self):
        self.ranges: list[list[Instance]] = []

    @property
    def replicated(self) -> bool:
        return any(len(r) > 1 for r in self.ranges)

    def instances(self) -> list[Instance]:
        return [i for r in self.ranges for i in r]

    def find(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances() if i.id == instance_id), None)

    def follow(self, primaries: list[Instance]) -> None:
        """The primary chain is now these instances, one per range (the pipeline's /info, each poll): replicas of a
        range whose layers are still a range of it stay; those of a range that is gone are dropped (callers refuse a
        re-split while replicas exist, so this is a pipeline that lost them)."""
        old = {i.id: i for i in self.instances()}
        ranges = []
        for p in primaries:
            # a promoted replica (promote) keeps the id its sequences' routes name, whatever its incarnation
            kept = old.get(p.id) or next((i for i in old.values() if i.primary and i.join_id is not None
                                          and i.url == p.url), None)
            if kept is not None and kept.layers == p.layers:
                p.id, p.join_id, p.incarnation = kept.id, kept.join_id, kept.incarnation or p.incarnation
                p.bound, p.ms_per_mb = kept.bound, p.ms_per_mb or kept.ms_per_mb
            replicas = [i for r in self.ranges for i in r if not i.primary and i.layers == p.layers
                        and i.url != p.url]
            ranges.append([p, *replicas])
        self.ranges = ranges

    def add(self, replica: Instance) -> int:
        """A replica of the range of its layers; returns the range's index. ValueError when no range has them."""
        for i, r in enumerate(self.ranges):
            if r[0].layers == replica.layers:
                if i == 0:
                    raise ValueError("the first range takes no replicas (the gateway sends to one first stage)")
                r.append(replica)
                return i
        raise ValueError(f"no range of the pipeline is {replica.layers[0]}:{replica.layers[1]}")

    def promote(self, dead_id: str, replica_id: str) -> Instance:
        """The primary `dead_id` is gone and its range's replica `replica_id` serves in its place from now on, as the
        range's primary under its own id (the routes of the sequences bound to it name that id). The dead one's
        sequences are bound to nothing any more (Scheduler.instance_lost rebinds them). KeyError when either is not
        where it is said to be."""
        for r in self.ranges:
            if r[0].id == dead_id:
                replica = next((i for i in r[1:] if i.id == replica_id), None)
                if replica is None:
                    raise KeyError(replica_id)
                r.remove(replica)
                replica.primary = True
                r[0] = replica
                return replica
        raise KeyError(dead_id)

    def remove(self, instance_id: str) -> Instance | None:
        for r in self.ranges:
            for i in r:
                if i.id == instance_id and not i.primary:
                    r.remove(i)
                    return i
        return None

    def hops(self) -> list[dict]:
        """What the "hops" phase tells the stages: every instance of every range after the first (empty without
        replicas: a stage then holds none and sends by its one next hop)."""
        return [i.wire() for r in self.ranges[1:] for i in r] if self.replicated else []

    def choose(self) -> tuple[str, ...] | None:
        """A new sequence's chain (the instance ids after the first range), or None without replicas: per range, the
        instance with the least predicted work; once a replica is chosen, the primaries after it (followable)."""
        if not self.replicated:
            return None
        route: list[Instance] = []
        off_primary = False
        for r in self.ranges[1:]:
            if off_primary:
                route.append(r[0])
                continue
            best = min(r, key=lambda i: (self._work(i, r), not i.primary))
            off_primary = not best.primary
            route.append(best)
        return tuple(i.id for i in route)

    @staticmethod
    def _work(instance: Instance, its_range: list[Instance]) -> float:
        """The predicted work on an instance with one sequence more: (its sequences + 1) x its measured ms per
        micro-batch (unmeasured: its range's primary's, else 1)."""
        return (len(instance.bound) + 1) * (instance.ms_per_mb or its_range[0].ms_per_mb or 1.0)

    def key(self, chain: tuple[str, ...] | None) -> tuple[str, ...]:
        """The chain a sequence's K/V lives on, as instance ids after the first range: `chain` itself, or the
        primaries' for None (a sequence admitted without replicas runs on the primary chain). Primaries keep their ids
        while the pipeline's cache identity does (a promotion or a re-split changes both), so a key names the same
        processes for as long as anything cached under it lives."""
        return chain if chain is not None else tuple(r[0].id for r in self.ranges[1:])

    def work(self, chain: tuple[str, ...] | None) -> float:
        """A chain's predicted work with one sequence more: its busiest instance's (what bounds its micro-batches)."""
        found = {i.id: (i, r) for r in self.ranges for i in r}
        return max((self._work(*found[i]) for i in self.key(chain) if i in found), default=0.0)

    def bind(self, seq_id: str, chain: tuple[str, ...]) -> None:
        for inst_id in chain:
            if (inst := self.find(inst_id)) is not None:
                inst.bound.add(seq_id)

    def unbind(self, seq_id: str, chain: tuple[str, ...] | None) -> None:
        for inst_id in chain or ():
            if (inst := self.find(inst_id)) is not None:
                inst.bound.discard(seq_id)

    def view(self) -> list[list[dict]]:
        """/v1/mesh's "instances": per range, every stage process serving it."""
        return [[i.view() for i in r] for r in self.ranges]
