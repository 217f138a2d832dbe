"""Mesh keys: one ZeroMQ CURVE key pair per role of a pipeline (the gateway, stage 0 .. stage N-1), in one directory.

A receiver (a stage's PULL, the gateway's result PULL) is a CURVE server with its own pair and accepts exactly one
client key: its configured upstream peer's (stage 0 <- gateway, stage i <- stage i-1, gateway <- stage N-1). A sender
connects as a CURVE client with its own pair and the next hop's public key. So every hop is encrypted, and every
receiver knows which single process may feed it.

Directory layout (`stagemesh keys DIR --stages N`, zmq.auth.create_certificates format, Z85 text):
    DIR/mesh.json                      {"stages": N}
    DIR/gateway.key   DIR/gateway.key_secret      public / public + secret (0600)
    DIR/stage0.key    DIR/stage0.key_secret ...
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass

import zmq.auth

from shared.errors import StagemeshError

KEYS_ENV = "STAGEMESH_KEYS"
MESH_FILE = "mesh.json"
GATEWAY = "gateway"
FIX = "create a key set with `stagemesh keys DIR --stages N` and pass --keys DIR (or set STAGEMESH_KEYS)"


def stage_role(index: int) -> str:
    return f"stage{index}"


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes


@dataclass(frozen=True)
class SocketKeys:
    """The CURVE keys of one process's two sockets. `accept_name`/`next_name` are roles, for messages and logs."""

    receive: KeyPair  # our PULL's server pair
    accept: bytes  # the only client public key our PULL lets in (the upstream peer's)
    accept_name: str
    send: KeyPair  # our PUSH's client pair
    next_server: bytes | None  # the next hop's server public key (None: this process sends nowhere)
    next_name: str | None = None


def write_key_set(directory: str, num_stages: int) -> list[str]:
    """A fresh key set for a mesh of num_stages stages; the directory is made 0700 and secret files 0600.
    Refuses to overwrite an existing key set (rotation = a new directory, then restart the mesh with it)."""
    if num_stages < 1:
        raise StagemeshError(f"--stages {num_stages} must be at least 1")
    if os.path.exists(os.path.join(directory, MESH_FILE)):
        raise StagemeshError(f"{directory} already holds a key set; write the new one to another directory (or "
                             "delete this one first)")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        old = os.umask(0o077)
        try:
            written = []
            for role in [GATEWAY, *(stage_role(i) for i in range(num_stages))]:
                public, secret = zmq.auth.create_certificates(directory, role)
                os.chmod(secret, 0o600)
                os.chmod(public, 0o644)
                written += [public, secret]
            with open(os.path.join(directory, MESH_FILE), "w") as f:
                json.dump({"stages": num_stages}, f)
        finally:
            os.umask(old)
    except OSError as e:
        raise StagemeshError(f"cannot write keys to {directory}: {e.strerror}; pass a writable directory") from None
    return written


def extract_role(source: str, directory: str, role: str) -> list[str]:
    """Copy into `directory` what one role's process needs of the key set in `source`: every role's public key, the
    stage count, and that role's secret key only (0600). A Kubernetes init container runs this, so a stage's
    container never holds another role's secret key (k8s/base). Returns the files written."""
    keys = KeySet(source)
    roles = [GATEWAY, *(stage_role(i) for i in range(keys.num_stages))]
    if role not in roles:
        raise StagemeshError(f"role {role!r} is not in the key set {source} (its roles: {', '.join(roles)})")
    keys.pair(role)  # the secret is there, readable, and matches its public key
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        written = []
        for name in [MESH_FILE, *(r + ".key" for r in roles), role + ".key_secret"]:
            target = os.path.join(directory, name)
            shutil.copyfile(os.path.join(source, name), target)
            os.chmod(target, 0o600 if name.endswith("_secret") else 0o644)
            written.append(target)
    except OSError as e:
        raise StagemeshError(f"cannot write {role}'s keys to {directory}: {e.strerror}; pass a writable directory") \
            from None
    return written


class KeySet:
    """A key directory, read on demand: each process reads its own secret and its two peers' public keys."""

    def __init__(self, directory: str):
        if not directory:
            raise StagemeshError(f"no key directory given; {FIX}")
        if not os.path.isdir(directory):
            raise StagemeshError(f"key directory {directory} does not exist; {FIX}")
        self.directory = directory
        path = os.path.join(directory, MESH_FILE)
        try:
            with open(path) as f:
                stages = json.load(f).get("stages")
        except FileNotFoundError:
            raise StagemeshError(f"{path} is missing: {directory} is not a stagemesh key set; {FIX}") from None
        except (OSError, ValueError, AttributeError) as e:
            raise StagemeshError(f"cannot read {path} ({e}); {FIX}") from None
        if not isinstance(stages, int) or stages < 1:
            raise StagemeshError(f"{path} does not give a stage count; {FIX}")
        self.num_stages = stages

    def _load(self, role: str, secret: bool) -> tuple[bytes, bytes | None]:
        path = os.path.join(self.directory, role + (".key_secret" if secret else ".key"))
        try:
            mode = os.stat(path).st_mode
            if secret and mode & stat.S_IROTH:
                raise StagemeshError(f"{path} is readable by every user; chmod 600 {path} (or 0440 for a group)")
            public, secret_key = zmq.auth.load_certificate(path)
        except FileNotFoundError:
            raise StagemeshError(f"key file {path} is missing; {FIX}") from None
        except PermissionError:
            raise StagemeshError(f"key file {path} is not readable by this user; fix its owner or mode "
                                 "(the process needs read access)") from None
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise StagemeshError(f"key file {path} is not a ZeroMQ certificate ({e}); {FIX}") from None
        if len(public or b"") != 40 or (secret and len(secret_key or b"") != 40):
            raise StagemeshError(f"key file {path} holds no {'secret' if secret else 'public'} Z85 key; {FIX}")
        return public, secret_key

    def pair(self, role: str) -> KeyPair:
        public, secret = self._load(role, secret=True)
        if public != self.public(role):
            raise StagemeshError(f"{self.directory}/{role}.key_secret and {role}.key hold different public keys; "
                                 f"copy both files from the same key set ({FIX})")
        return KeyPair(public, secret)

    def public(self, role: str) -> bytes:
        return self._load(role, secret=False)[0]

    def check_stages(self, num_stages: int, who: str) -> None:
        if num_stages != self.num_stages:
            raise StagemeshError(f"key set {self.directory} is for {self.num_stages} stages, {who} has {num_stages}; "
                                 f"make one with `stagemesh keys DIR --stages {num_stages}`")

    def role_of(self, index: int) -> str:
        if not 0 <= index < self.num_stages:
            raise StagemeshError(f"stage index {index} has no keys in {self.directory} (a set for {self.num_stages} "
                                 f"stages); make one with `stagemesh keys DIR --stages {index + 1}` or more")
        return stage_role(index)

    def upstream_of(self, index: int) -> str:
        return GATEWAY if index == 0 else self.role_of(index - 1)

    def for_stage(self, index: int, last: bool) -> SocketKeys:
        """Stage `index`: accepts only its upstream peer, sends to stage index+1 (or the gateway when last)."""
        me = self.pair(self.role_of(index))
        up = self.upstream_of(index)
        down = GATEWAY if last else self.role_of(index + 1)
        return SocketKeys(me, self.public(up), up, me, self.public(down), down)

    def for_gateway(self, enter_at: int = 0) -> SocketKeys:
        """The gateway: sends into stage `enter_at` (0 in service; a test may enter later, as that stage's upstream
        peer) and accepts results only from the last stage."""
        last = self.role_of(self.num_stages - 1)
        sender = self.upstream_of(enter_at)
        return SocketKeys(self.pair(GATEWAY), self.public(last), last, self.pair(sender),
                          self.public(self.role_of(enter_at)), self.role_of(enter_at))


EPHEMERAL_PREFIX = "stagemesh-keys-"  # + the owner's pid + "-" + random: a private key set made for one launch


def ephemeral_key_set(num_stages: int) -> str:
    """A fresh key set in a private (0700) temporary directory named after this process, made after removing the ones
    that processes no longer alive left behind: a launcher that was SIGKILLed could not delete its own, and its
    secret keys must not outlive it for long. The caller deletes the directory when it stops."""
    sweep_orphan_key_sets(tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=f"{EPHEMERAL_PREFIX}{os.getpid()}-")
    write_key_set(directory, num_stages)
    return directory


def sweep_orphan_key_sets(parent: str) -> list[str]:
    """Delete the ephemeral key sets in `parent` that this user's processes made and that are no longer alive;
    returns their paths. Another user's, a living process's and anything not named so are left alone."""
    removed = []
    for name in os.listdir(parent):
        m = re.fullmatch(rf"{EPHEMERAL_PREFIX}(\d+)-[A-Za-z0-9_]+", name)
        if not m:
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _alive(int(m.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
