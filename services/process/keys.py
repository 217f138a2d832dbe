"""`stagemesh keys DIR --stages N` writes a mesh's CURVE key set; the --keys / --insecure-plaintext flags that
`stage`, `gateway` and `up` share are declared and resolved here."""

from __future__ import annotations

import argparse
import logging
import os

from shared.errors import StagemeshError
from shared.wire.mesh_keys import KEYS_ENV, KeySet, extract_role, write_key_set

log = logging.getLogger("stagemesh.keys")


def register(sub) -> None:
    p = sub.add_parser("keys", help="write a CURVE key set for a mesh of N stages",
                       description="Write one CURVE key pair per role (gateway, stage 0..N-1) into DIR (created 0700, "
                                   "secret files 0600). Give DIR to every process with --keys DIR; in Kubernetes: "
                                   "kubectl create secret generic stagemesh-keys --from-file=DIR. With --role ROLE "
                                   "--from SET instead: copy into DIR what ROLE needs of the key set SET (every "
                                   "public key, ROLE's secret key only), as the Kubernetes pods' init containers do")
    p.add_argument("directory", metavar="DIR", help="directory to create (must not hold a key set already)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--stages", type=int, help="number of stages in the mesh")
    what.add_argument("--role", help="gateway, stage0, stage1, ...: the one role whose secret key DIR gets")
    p.add_argument("--from", dest="source", metavar="SET", help="with --role: the key set to copy from")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args) -> int:
    if args.role is not None:
        if not args.source:
            raise StagemeshError("--role needs --from SET, the key set to copy the role's keys from")
        written = extract_role(args.source, args.directory, args.role)
        print(f"wrote {len(written)} key files for {args.role} to {args.directory}")
        return 0
    if args.source:
        raise StagemeshError("--from goes with --role ROLE (copy one role's keys); --stages writes a new key set")
    written = write_key_set(args.directory, args.stages)
    print(f"wrote {len(written)} key files for a gateway and {args.stages} stages to {args.directory}")
    return 0


def add_security_args(p: argparse.ArgumentParser, up: bool = False) -> None:
    if not up:
        p.add_argument("--keys", default=os.environ.get(KEYS_ENV), metavar="DIR",
                       help=f"the mesh's key set from `stagemesh keys` (default: ${KEYS_ENV}); stage and result "
                            "sockets then use CURVE (encrypted, each accepts only its upstream peer)")
    p.add_argument("--insecure-plaintext", action="store_true",
                   help="no keys: activations and results travel unencrypted and any process that can reach a "
                        "stage port can feed it (trusted, isolated networks only)")


def key_set_from_args(args, who: str) -> KeySet | None:
    """The KeySet to use, or None for plaintext (only with --insecure-plaintext, logged as a warning)."""
    keys = getattr(args, "keys", None)
    if args.insecure_plaintext:
        if keys:
            raise StagemeshError("--keys and --insecure-plaintext contradict each other; pass one")
        log.warning("%s: --insecure-plaintext: stage traffic is NOT encrypted or authenticated; any process that "
                    "can reach the stage and result ports can read and inject it", who)
        return None
    if not keys:
        raise StagemeshError(f"{who} needs the mesh's keys: --keys DIR (from `stagemesh keys DIR --stages N`, or "
                             f"${KEYS_ENV}), or --insecure-plaintext on a trusted network")
    return KeySet(keys)


JOIN_TOKEN_ENV = "STAGEMESH_JOIN_TOKEN"


def add_join_token_arg(p: argparse.ArgumentParser) -> None:
    """--join-token (gateway, up): hosts that prove it may join the running mesh (`stagemesh join`)."""
    p.add_argument("--join-token", default=os.environ.get(JOIN_TOKEN_ENV), metavar="TOKEN|auto",
                   help=f"accept hosts that prove this token (`stagemesh join URL --token TOKEN`) as new stages of the "
                        f"running mesh; auto: a random one, printed with the join command (default: ${JOIN_TOKEN_ENV}; "
                        "none: joins are refused). A token holder can serve layers and sees activations: "
                        "docs/security.md")


def join_token_from_args(args) -> str | None:
    """The join token to accept (None: joins off); `auto` makes a random one (the caller prints the join command)."""
    import secrets

    token = getattr(args, "join_token", None)
    if not token:
        return None
    if token == "auto":
        return secrets.token_urlsafe(24)
    if len(token) < 16:
        raise StagemeshError(f"--join-token must be 16 characters at least (it has {len(token)}); or pass auto")
    return token
