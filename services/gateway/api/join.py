"""The join endpoints (`stagemesh join` is their client; services/gateway/engine/membership.py does the work). Outside
/v1/: their own proof is the join token, a client's API key neither opens nor is needed for them.

  POST /join/hello                       -> {"nonce"}  (one use, NONCE_S)
  POST /join {nonce, key, report, proof, as?}
                                         -> the joiner's place: {id, layers, place, upstream_key, upstream_before_key,
                                            next: {address, key}, ..., mac}
  POST /join/ready {id, nonce, proof}    -> the pipeline went from N to N+1 stages: {..., mac}
  POST /join/leave {id, nonce, proof}    -> the pipeline went from N to N-1 stages: {..., mac}

proof: HMAC-SHA256(token, "join|nonce|key|sha256(report)"), "ready|id|nonce" or "leave|id|nonce" (engine.membership
mac); mac: the gateway's HMAC of the answer under the token. A request without a valid proof gets 401 and nothing
else; every request counts against the join rate (429 with Retry-After past it)."""

from __future__ import annotations

from aiohttp import web

from services.gateway.engine.membership import JoinError, Membership, digest, mac
from services.gateway.engine.replica_joins import ReplicaJoins
from services.gateway.frontend.frontend import GATEWAY, json_body, run_while_serving
from services.gateway.frontend.schemas import RequestError

MEMBERSHIP = web.AppKey("membership", Membership)
REPLICAS = web.AppKey("replica_joins", ReplicaJoins)  # joiners placed as replicas of a stage (--as replica)


def _refusal(e: JoinError) -> web.Response:
    code = {401: "invalid_join_token", 409: "join_not_now", 410: "join_dropped", 429: "too_many_joins"}.get(
        e.status, "join_refused")
    headers = {"Retry-After": str(getattr(e, "retry_after", 1))} if e.status == 429 else None
    return web.json_response(RequestError(str(e), status=e.status, code=code).openai_body(), status=e.status,
                             headers=headers)


async def _body(request: web.Request, fields: set[str], optional: set[str] = frozenset()) -> dict:
    body = await json_body(request)
    unknown = set(body) - fields - optional
    missing = fields - set(body)
    if unknown or missing:
        raise RequestError(f"{'unknown field ' + repr(sorted(unknown)[0]) if unknown else 'missing ' + sorted(missing)[0]}"
                           f": a join request carries {', '.join(sorted(fields))}", param=sorted(unknown or missing)[0])
    return body


async def hello(request: web.Request) -> web.Response:
    m = request.app[MEMBERSHIP]
    try:
        m.limit()
    except JoinError as e:
        return _refusal(e)
    return web.json_response({"nonce": m.challenge()})


async def join(request: web.Request) -> web.Response:
    m = request.app[MEMBERSHIP]
    try:
        m.limit()
        body = await _body(request, {"nonce", "key", "report", "proof"}, {"as"})
        report, key = body["report"], body["key"]
        if not isinstance(report, dict) or not (key is None or isinstance(key, str)):
            raise JoinError("join refused: no valid proof of the join token", 401)
        nonce = m.check_proof(body["nonce"], body["proof"], "join", str(body["nonce"]), key or "", digest(report))
        role = body.get("as")
        if role not in (None, "stage", "replica"):
            raise JoinError(f"as {role!r}: a joiner joins as a new stage (\"stage\") or a replica of one "
                            "(\"replica\")")
        replicas = request.app[REPLICAS]
        if role == "replica" or (role is None and replicas.prefers(report)):
            return web.json_response(m.answer(nonce, await replicas.place(nonce, report, key, role == "replica",
                                                                          request.url.host)))
        if replicas.table.replicated:
            raise JoinError("the mesh has replicas of a stage: a new stage re-splits one process per range; join "
                            "with --as replica, or let the replicas leave first", 409)
        return web.json_response(m.answer(nonce, m.place(nonce, report, key, role == "stage",
                                                         request.url.host)))
    except JoinError as e:
        return _refusal(e)


async def _proven(request: web.Request, what: str) -> tuple[Membership, str, str]:
    m = request.app[MEMBERSHIP]
    m.limit()
    body = await _body(request, {"id", "nonce", "proof"})
    join_id = body["id"]
    if not isinstance(join_id, str):
        raise JoinError("no valid proof of the join token", 401)
    nonce = m.check_proof(body["nonce"], body["proof"], what, join_id, str(body["nonce"]))
    return m, join_id, nonce


async def _step(request: web.Request, what: str) -> web.Response:
    """A proven ready or leave (`what`), done by ReplicaJoins for a join of its own (a replica placed, for ready;
    one serving, for leave), else by Membership."""
    try:
        m, join_id, nonce = await _proven(request, what)
        replicas = request.app[REPLICAS]
        if join_id in (replicas.joins if what == "ready" else replicas.joined):
            step = replicas.ready if what == "ready" else replicas.leave
        else:
            step = m.ready if what == "ready" else m.leave
        return web.json_response(m.answer(nonce, await step(join_id)))
    except JoinError as e:
        return _refusal(e)


async def ready(request: web.Request) -> web.Response:
    return await _step(request, "ready")


async def leave(request: web.Request) -> web.Response:
    return await _step(request, "leave")


async def members(request: web.Request) -> web.Response:
    """GET /v1/mesh/members: the joined stages, the joiners placed and not yet ready, and the last joins, leaves and
    losses (under /v1/: the API key's, as /v1/mesh)."""
    return web.json_response({**request.app[MEMBERSHIP].info(), **request.app[REPLICAS].info()})


def add_join_api(app: web.Application, membership: Membership) -> None:
    """Routes and the watch task of the join endpoints (make_app calls it when the gateway has a join token)."""
    app[MEMBERSHIP] = membership
    app[REPLICAS] = ReplicaJoins(membership, app[GATEWAY].replicas.all[0].engine)
    run_while_serving(app, {"membership-watch": app[MEMBERSHIP].watch, "replica-watch": app[REPLICAS].watch})
    app.router.add_post("/join/hello", hello)
    app.router.add_post("/join", join)
    app.router.add_post("/join/ready", ready)
    app.router.add_post("/join/leave", leave)
    app.router.add_get("/v1/mesh/members", members)


__all__ = ["MEMBERSHIP", "add_join_api", "mac"]
