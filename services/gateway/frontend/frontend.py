"""The request lifecycle of the gateway: the Gateway object the handlers share (prepare, start, events, drain), the
tokenize lanes, and the app key it is stored under. The handlers (openai_api.py, ws.py) and the mesh view import it
from here; app.py composes them into the aiohttp application."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from aiohttp import WSCloseCode, web

from services.gateway.config import (
    BODY_READ_TIMEOUT_S,
    FLUSH_AFTER_DRAIN_S,
    MAX_BIG_PROMPTS_WAITING,
    SMALL_PROMPT_CHARS,
    GatewayConfig,
)
from services.gateway.engine.metrics import GatewayMetrics
from services.gateway.engine.replicas import Replicas
from services.gateway.engine.request import Request, RequestOutput, TraceCapture, new_seq_id
from services.gateway.engine.scheduler import QueueFull
from services.gateway.frontend.durable import RequestStore, StoredRequest
from services.gateway.frontend.events import RequestHandle, RequestRegistry
from services.gateway.frontend.output import (
    END_EVENTS,
    ClientEvent,
    DoneEvent,
    ErrorEvent,
    OutputProcessor,
    TokenEvent,
)
from services.gateway.frontend.schemas import GenerationSpec, RequestError, parse_generation, parse_json_text
from services.gateway.frontend.tools import ToolCallParser, forced_call_schema, tool_messages
from shared.errors import ChatTemplateError
from shared.runtime.model_files import ModelFiles
from shared.text.grammar import GrammarError, json_schema_grammar

log = logging.getLogger("stagemesh.gateway")
RESUME_GRACE_S = 120.0  # a resumable request with no reader ends after this long (cancelled, its slots freed)
READOPT_WAIT_S = 60.0  # a reconnecting client waits at most this long for a restarted gateway to take requests back
access_log = logging.getLogger("stagemesh.gateway.access")  # one line per generation request, when it ends


async def json_body(request: web.Request) -> dict:
    """The body as a JSON object, read within BODY_READ_TIMEOUT_S (a trickled body is cut with 408)."""
    try:
        raw = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s", status=408,
                           code="body_timeout") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the body is not valid UTF-8 (byte {e.start})") from None
    body = parse_json_text(text)
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def run_while_serving(app: web.Application, runs: dict[str, Callable[[], Coroutine]]) -> None:
    """Run each of `runs` (task name -> its coroutine function) as a task from the app's startup to its cleanup,
    where each is cancelled and awaited."""

    async def running(app: web.Application):
        tasks = [asyncio.create_task(run(), name=name) for name, run in runs.items()]
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.cleanup_ctx.append(running)


# the status of a request that failed while generating: its own fault (a 4xx, not to be retried as it is), its
# deadline, or the server's (503, retried after a second)
ERROR_STATUS = {"grammar_failed": 400, "timeout": 504}


def error_status(ev: ErrorEvent) -> RequestError:
    """A request's error event as the HTTP error a client gets (whole answers; a stream sends it as an event)."""
    return RequestError(ev.message, status=ERROR_STATUS.get(ev.code, 503), code=ev.code)


def tool_parser(spec: GenerationSpec, request_id: str) -> ToolCallParser | None:
    """The parser that reads tool calls out of a request's text, when it has tools (its calls named by the request,
    the same on every reading)."""
    return ToolCallParser(forced=spec.forced_tool, request_id=request_id) if spec.tools is not None else None


class TokenizeLanes:
    """Tokenization off the event loop, in two lanes: prompts of at most SMALL_PROMPT_CHARS characters share two
    threads; longer ones go one at a time through a third, in arrival order. So a burst of big prompts queues behind
    itself, never in front of a small request, and at most one big prompt tokenizes at any moment."""

    def __init__(self):
        self.small = ThreadPoolExecutor(2, thread_name_prefix="tokenize-small")
        self.big = ThreadPoolExecutor(1, thread_name_prefix="tokenize-big")
        self.big_waiting = 0  # big prompts submitted and not yet tokenized (<= MAX_BIG_PROMPTS_WAITING)

    async def run(self, chars: int, fn, arg):
        loop = asyncio.get_running_loop()
        if chars <= SMALL_PROMPT_CHARS:
            return await loop.run_in_executor(self.small, fn, arg)
        if self.big_waiting >= MAX_BIG_PROMPTS_WAITING:
            raise RequestError(f"{self.big_waiting} long prompts are already waiting to be tokenized; retry shortly "
                               f"or send prompts of at most {SMALL_PROMPT_CHARS} characters", status=429,
                               code="queue_full")
        self.big_waiting += 1
        try:
            return await loop.run_in_executor(self.big, fn, arg)
        finally:
            self.big_waiting -= 1

    def close(self) -> None:
        for ex in (self.small, self.big):
            ex.shutdown(wait=False, cancel_futures=True)


def prompt_char_cap(files: ModelFiles, context: int) -> int:
    """The most characters a prompt can have and still fit `context` tokens: no token of this vocabulary covers
    more than its longest token's characters (byte-level tokens: one character per byte, and a byte is at most
    one character), so a longer prompt needs more than `context` tokens. Checked before tokenizing."""
    vocab = files.tokenizer.plain.get_vocab()
    longest = max(len(t) for t in vocab) if vocab else 1
    return context * max(1, longest)


@dataclass
class Gateway:
    """What the handlers need, in one typed object stored on the app."""

    files: ModelFiles
    replicas: Replicas  # the pipelines and the router that picks one per request (one pipeline: exactly as before)
    metrics: GatewayMetrics
    config: GatewayConfig
    lanes: TokenizeLanes = field(default_factory=TokenizeLanes)
    draining: bool = False  # set on SIGTERM: /ready answers 503 "draining" and no request is admitted
    requests: RequestRegistry = field(default_factory=RequestRegistry)  # open requests' handles, and recent ones
    epoch: str = field(default_factory=lambda: secrets.token_hex(4))  # this process's: an event id's first part
    open_streams: int = 0  # readers following an event log (Gateway.events) not yet ended
    websockets: set = field(default_factory=set)  # open web.WebSocketResponse objects, closed after a drain
    _char_cap: tuple[int, int] | None = None  # (context, cap) cache for prompt_char_cap
    store: RequestStore | None = None  # the durable request log (services/gateway/frontend/durable.py); None: --state-dir off
    durable: dict[str, int] = field(default_factory=dict)  # logged requests' ids -> output tokens logged so far
    keep_logged: bool = False  # set as a drain ends what still runs: those stay logged for the next gateway
    # a re-adopted detached request's handle and what its surface logged with it (the Responses API's record)
    on_readopt: Callable[[RequestHandle, dict], None] | None = None
    readopted: asyncio.Event = field(default_factory=asyncio.Event)  # set once the start's readopt() has registered

    def __post_init__(self):
        # what readopt() takes back
        self._unfinished = self.store.unfinished(self.config.state_keep_s) if self.store is not None else []
        if not self._unfinished:
            self.readopted.set()
        if self.store is not None:
            self.epoch = self.store.epoch  # event ids stay valid across restarts on this state directory
            for replica in self.replicas.all:  # their K/V stays on stages that still hold it (read on in place)
                replica.pipeline.spare = {s.id for s in self._unfinished if s.outputs and s.finish is None}

    def char_cap(self, context: int) -> int:
        if self._char_cap is None or self._char_cap[0] != context:
            self._char_cap = (context, prompt_char_cap(self.files, context))
        return self._char_cap[1]

    async def prepare(self, spec: GenerationSpec) -> Request:
        """Check the size, tokenize (off the loop, in a lane by size: chat templates may take up to their time
        cap) and check the context."""
        if spec.trace and not self.config.allow_trace:  # another request's activations, the model's internals
            raise RequestError("\"trace\" is an operator's debugging tool and this gateway does not answer it: start "
                               "the gateway (or up) with --allow-trace, or leave \"trace\" out", "trace", status=403,
                               code="trace_disabled")
        if self.draining:
            raise RequestError("the gateway is draining before it stops; retry on another replica or shortly",
                               status=503, code="draining")
        if not self.replicas.ready:
            raise RequestError(f"the pipeline is not ready: {self.replicas.problem}", status=503, code="not_ready")
        context = self.replicas.max_seq_len
        param = "messages" if spec.messages is not None else "prompt"
        ids = await self.prompt_ids(spec, context)
        grammar = None
        schema = forced_call_schema(spec.tools, spec.tool_choice) if spec.forced_tool else spec.json_schema
        if schema is not None:  # compiled off the loop (the first one also builds llguidance's vocabulary)
            try:
                grammar = await self.lanes.run(0, self.files.grammars.matcher, json_schema_grammar(schema))
            except GrammarError as e:
                raise RequestError(f"the JSON schema cannot constrain the output: {e}",
                                   "tools" if spec.forced_tool else "response_format") from None
        if not ids:
            raise RequestError("the prompt is empty after tokenization", "prompt")
        if len(ids) >= context:
            raise RequestError(f"the prompt has {len(ids)} tokens; this deployment's context is {context} tokens",
                               "messages" if spec.messages is not None else "prompt", code="context_length_exceeded")
        # no max_tokens: until a stop or the context is full (OpenAI's meaning), within the operator's cap if set,
        # and within the K/V memory the stages give one request
        room = min(context, self.replicas.live_positions or context)
        if len(ids) >= room:
            raise RequestError(f"the prompt has {len(ids)} tokens; the stages' K/V memory holds {room} positions for "
                               "one request (their --memory-budget); shorten it", param, code="kv_memory_exceeded")
        max_tokens = spec.max_tokens or min(self.config.default_max_tokens or context, room - len(ids))
        if len(ids) + max_tokens > context:
            raise RequestError(f"prompt ({len(ids)} tokens) + {{param}} ({max_tokens}) exceeds the context of "
                               f"{context} tokens; lower {{param}}", "max_tokens", code="context_length_exceeded")
        if len(ids) + max_tokens > room:
            raise RequestError(f"prompt ({len(ids)} tokens) + {{param}} ({max_tokens}) needs more K/V memory than "
                               f"the stages hold for one request ({room} positions, their --memory-budget); lower "
                               "{param}", "max_tokens", code="kv_memory_exceeded")
        timeout = spec.timeout_s or self.config.request_timeout_s
        prediction = None
        if spec.prediction is not None:  # tokenized as the output will be: without BOS
            prediction = await self.lanes.run(len(spec.prediction), self._encode_plain, spec.prediction)
        return Request(seq_id=new_seq_id(), prompt_ids=ids, params=spec.sampling.with_seed(), max_tokens=max_tokens,
                       cache_tenant=spec.cache_tenant, prediction_ids=prediction, speculation=spec.speculation,
                       stop_ids=frozenset() if spec.ignore_eos else self.files.tokenizer.eos_ids,
                       deadline=time.perf_counter() + timeout, grammar=grammar,
                       capture=TraceCapture(self.config.trace_budget) if spec.trace else None)

    async def prompt_ids(self, spec: GenerationSpec, context: int) -> list[int]:
        """The prompt's token ids: the messages rendered by the chat template (tools, calls and results written in
        as tools.py says), or the prompt text, tokenized off the loop. A prompt longer in characters than `context`
        tokens can hold is refused before any tokenizing."""
        param = "messages" if spec.messages is not None else "prompt"
        chars = sum(len(m["content"]) for m in spec.messages) if spec.messages is not None else len(spec.prompt)
        cap = self.char_cap(context)
        if chars > cap:  # refused before any tokenizing: cannot fit, whatever its tokens
            raise RequestError(f"the prompt has {chars} characters, more than {context} tokens can hold "
                               f"(at most {cap} characters here); shorten it", param, code="context_length_exceeded")
        try:
            if spec.messages is not None:
                render = partial(self.files.chat_prompt_ids, continue_final=spec.continue_final)
                return await self.lanes.run(chars, render, tool_messages(spec.messages, spec.tools))
            return await self.lanes.run(chars, self.files.tokenizer.encode, spec.prompt)
        except ChatTemplateError as e:
            raise RequestError(str(e), "messages") from None

    async def count_prompt(self, body: dict) -> int:
        """The tokens a chat request's prompt would have (its messages and tools through the chat template, as
        `start` renders them), without running it."""
        context = self.replicas.max_seq_len or 1 << 20
        spec = parse_generation(body, True, context, self.files.tokenizer.vocab_size)
        return len(await self.prompt_ids(spec, context))

    def _encode_plain(self, text: str) -> list[int]:
        return self.files.tokenizer.encode(text, add_bos=False)

    def submit(self, seq: Request, session: str | None = None) -> None:
        try:
            self.replicas.submit(seq, session)
        except QueueFull as e:
            raise RequestError(str(e), status=429, code="queue_full") from None

    async def start(self, body: dict, chat: bool, session: str | None = None,
                    cancel_on_leave: bool = True, detached: dict | None = None,
                    keep_log: bool = False) -> RequestHandle:
        """Validate, tokenize and queue one generation request; its handle is registered before it can produce
        anything. `session` (a header) or the body's OpenAI `user` keeps a conversation on one pipeline
        (Replicas.route). `cancel_on_leave`: see RequestHandle. `detached` (a background response's record): the
        request runs without readers until it ends, and is logged with it, so a restarted gateway takes it back
        without waiting for a reader and gives the record back to its surface (on_readopt). Its events stay
        readable after it ends only where something may read them again: a request that outlives its connection
        (resumable, detached) or keep_log (a stored response); the others' go with their end."""
        spec = parse_generation(body, chat, self.replicas.max_seq_len or 1 << 20, self.files.tokenizer.vocab_size)
        user = body.get("user")
        client = user if isinstance(user, str) else ""
        if spec.resumable or detached is not None:
            self._check_unattended(client)
        seq = await self.prepare(spec)
        handle = RequestHandle(seq, spec, OutputProcessor(seq, self.files.tokenizer, spec.stop),
                               cancel_on_leave=cancel_on_leave and not spec.resumable, client=client,
                               detached=detached is not None)
        handle.kept = not handle.cancel_on_leave or keep_log
        self.requests.add(handle)
        route = session or client or None
        try:
            self.submit(seq, route)
        except RequestError:
            self.requests.open.pop(handle.id, None)  # refused: it never existed
            raise
        # (a grammar's state is not logged; past --state-max-requests the request runs unlogged)
        if (spec.resumable or detached is not None) and self.store is not None and seq.grammar is None \
                and len(self.durable) < self.config.state_max_requests:
            self.store.add(handle.id, body, chat, route, seq.params.seed or 0,
                           {"detached": detached} if detached is not None else None)
            self.durable[handle.id] = 0
        return handle

    def _check_unattended(self, client: str) -> None:
        """A request that may run without a connection (background, resumable) is refused with 429 while its client
        already has --max-detached-per-user such requests running unattended: no client holds the mesh's slots and
        queue with work nobody waits for."""
        bound = self.config.max_detached_per_user
        held = sum(1 for h in self.requests.open.values() if h.client == client and h.unattended)
        if held >= bound:
            who = f"user {client[:80]!r}" if client else "requests without a `user`"
            raise RequestError(f"{who} already has {held} requests running with no connection waiting for them "
                               f"(background, or resumable and unread): at most {bound} at once (the gateway's "
                               "--max-detached-per-user); read or cancel one, or retry when one ends", status=429,
                               code="too_many_detached")

    async def readopt(self, stored: list[StoredRequest] | None = None) -> int:
        """Take back the requests a previous gateway on this state directory left unfinished (durable.py): each
        with its id, seed and tokens so far, its event log rebuilt to the same offsets. At start (stored None: what
        the log held then), where it has produced tokens it goes on in place: the stages that outlived the gateway
        kept its K/V (the pipeline's first release spared it) for every position but the newest token's, so its
        next step is the decode of that token; a stage that lost it (it restarted too) answers unknown_sequence,
        and the engine replays it in full from its tokens, as after a failover. `stored` given (a peer's requests,
        taken over while serving: take_over): prefilled again, prompt and tokens, as is one that produced nothing.
        One that had ended (its finish logged) only gets its events back, ended, for a client to read its tail.
        Returns how many."""
        in_place = stored is None
        if stored is None:
            stored, self._unfinished = self._unfinished, []
        try:
            return await self._readopt(stored, in_place)
        finally:
            if in_place:
                self.readopted.set()

    async def _readopt(self, stored: list[StoredRequest], in_place: bool) -> int:
        if not stored:
            return 0
        while not self.replicas.ready:
            await asyncio.sleep(0.05)
        adopted = 0
        for s in stored:
            try:
                spec = parse_generation(s.body, s.chat, self.replicas.max_seq_len or 1 << 20,
                                        self.files.tokenizer.vocab_size)
                seq = await self.prepare(spec)
            except RequestError as e:
                log.warning("request %s from the request log cannot run again: %s", s.id, e.message)
                if s.finish is None:
                    self.store.end(s.id, {"finish_reason": "error", "error": e.message})
                continue
            seq.seq_id = s.id
            if not seq.params.greedy:
                seq.params = dataclasses.replace(seq.params, seed=s.seed)
            detached = s.extra.get("detached")
            user = s.body.get("user")  # no connection has it yet: unattended until a reader comes back
            handle = RequestHandle(seq, spec, OutputProcessor(seq, self.files.tokenizer, spec.stop),
                                   cancel_on_leave=False, created=int(s.created), client=user if isinstance(user, str)
                                   else "", detached=detached is not None, left=True)
            outputs = s.outputs if s.finish is not None else s.outputs[:max(0, seq.max_tokens - 1)]
            for token, logprob, top in outputs:
                alternatives = [tuple(t) for t in top] if top is not None else None
                for ev in handle.processor.process(RequestOutput(token, logprob, alternatives)):
                    handle.log.append(ev)
                seq.output_ids.append(token)
                seq.logprobs.append(logprob)
                seq.top_logprobs.append(alternatives)
            if s.finish is not None:  # it had ended: its last output, and its events are all back
                f = s.finish
                top = [tuple(t) for t in f["top"]] if f.get("top") is not None else None
                for ev in handle.processor.process(RequestOutput(f.get("token"), f.get("logprob"), top,
                                                                 f.get("finish_reason"), f.get("error"), f.get("code"))):
                    handle.log.append(ev)
                self.requests.add(handle)
                self.requests.mark_ended(handle)
                if detached is not None and self.on_readopt is not None:
                    self.on_readopt(handle, detached)
                continue
            seq._generated.update(seq.output_ids)  # the penalties' history
            if in_place and seq.output_ids:
                # positions [0, len - 1) are on the stages (or the replay prefills them): decode the newest token next
                seq.prefill_target = seq.computed = len(seq.all_ids) - 1
            else:
                seq.prefill_target = len(seq.all_ids)
            self.requests.add(handle)
            self.durable[s.id] = len(seq.output_ids)
            self.submit(seq, s.session)
            if detached is None:  # a resumable request: a reader comes back, or it ends
                asyncio.get_running_loop().call_later(RESUME_GRACE_S, self._cancel_if_unread, handle)
            elif self.on_readopt is not None:  # a background response: its record, back where its surface keeps it
                self.on_readopt(handle, detached)
            adopted += 1
        log.info("re-adopted %d unfinished requests from the request log", adopted)
        return adopted

    async def wait_readopted(self) -> None:
        """Until the start's readopt() has registered what the log held (at most READOPT_WAIT_S): a client that
        reconnects as a restarted gateway comes up must not be told its stream is unknown."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(READOPT_WAIT_S):
                await self.readopted.wait()

    async def find(self, request_id: str) -> RequestHandle | None:
        """A resumable request's handle by id, open or recently ended, once wait_readopted() returned: what
        GET /v1/streams and a websocket's resume read again. Requests not sent as resumable are never replayed
        there (None), whoever knows their id."""
        await self.wait_readopted()
        handle = self.requests.get(request_id)
        return handle if handle is not None and handle.spec.resumable else None

    def forget(self, request_id: str) -> None:
        """Drop what the gateway keeps of a request (DELETE /v1/responses/{id}): its events (a running one is
        cancelled, and its events go at its end, once its readers have it) and its rows in the durable log."""
        handle = self.requests.open.get(request_id)
        if handle is not None:
            handle.kept = False
            self.replicas.cancel(handle.seq)
        self.requests.forget(request_id)
        self.durable.pop(request_id, None)  # nothing more of it is logged
        if self.store is not None:
            self.store.forget(request_id)

    async def take_over(self) -> int:
        """A shared log's (Redis's) requests whose gateway stopped renewing its lease, taken and re-adopted here."""
        stored = await asyncio.to_thread(self.store.unfinished, self.config.state_keep_s)
        return await self.readopt(stored) if stored else 0

    def deliver(self, seq: Request, out: RequestOutput) -> None:
        """What an engine reports for one request, made into client events once and appended to its log. A stop
        string ends the request here: the scheduler frees its slots and reports the finish (which comes back
        through here as the done event). Outputs of requests without a handle (the prefix audit's twins) are the
        engine's own."""
        handle = self.requests.open.get(seq.seq_id)
        if handle is None:
            return
        proc = handle.processor
        already_stopped = proc.stop_string_hit
        logged = self.durable.get(seq.seq_id)
        if logged is not None and out.token is not None and out.finish_reason is None:
            self.store.output(seq.seq_id, logged, out.token, out.logprob, out.top_logprobs)
            self.durable[seq.seq_id] = logged + 1
        for ev in proc.process(out):
            if isinstance(ev, END_EVENTS):
                _log_access(seq)  # logged before any reader sees the end
            handle.log.append(ev)
        if handle.log.ended:
            self.requests.mark_ended(handle, keep=handle.kept)
            if self.durable.pop(seq.seq_id, None) is not None and not self.keep_logged:
                top = [[int(t), float(lp)] for t, lp in out.top_logprobs] if out.top_logprobs is not None else None
                self.store.end(seq.seq_id, {"token": out.token, "logprob": out.logprob, "top": top,
                                            "finish_reason": out.finish_reason, "error": out.error, "code": out.code})
        elif proc.stop_string_hit and not already_stopped:
            self.replicas.finish(seq, "stop")

    async def events(self, handle: RequestHandle, start: int = 0) -> AsyncIterator[tuple[int, ClientEvent]]:
        """(offset, event) of the request's client events from offset `start`, ending with its done or error event.
        Reading takes nothing from the log: other readers, and later ones, see the same events."""
        self.open_streams += 1
        handle.readers += 1
        try:
            async for item in handle.log.follow(start):
                yield item
        finally:
            self.open_streams -= 1
            handle.readers -= 1

    async def collect(self, handle: RequestHandle) -> tuple[list[TokenEvent], DoneEvent]:
        """A whole answer: its token events and its done event; its error event raises as the HTTP error."""
        tokens = []
        async with contextlib.aclosing(self.events(handle)) as events:
            async for _, ev in events:
                if isinstance(ev, TokenEvent):
                    tokens.append(ev)
                elif isinstance(ev, ErrorEvent):
                    raise error_status(ev)
                else:
                    return tokens, ev
        raise AssertionError("the event stream ended without done or error")

    def leave(self, handle: RequestHandle) -> None:
        """A reader is done (its client went away, or its handler returned): end the request unless it outlives its
        connections (cancel_on_leave False). No-op once it ended."""
        handle.left = True
        if handle.cancel_on_leave:
            self.replicas.cancel(handle.seq)
        elif not handle.log.ended:  # resumable: checked RESUME_GRACE_S from now, when a reader may have come back
            asyncio.get_running_loop().call_later(RESUME_GRACE_S, self._cancel_if_unread, handle)

    def _cancel_if_unread(self, handle: RequestHandle) -> None:
        if handle.readers == 0 and not handle.log.ended:
            log.info("request %s: no reader came back within %g s; cancelled", handle.id, RESUME_GRACE_S)
            self.replicas.cancel(handle.seq)

    async def drain(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish for up to grace_s, end the rest with an error event that
        says why, give handlers time to send it, then close the websockets. Connections are still open throughout:
        call this before the runner's cleanup."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while not self.replicas.idle and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.keep_logged = True  # what is ended now goes on under the next gateway on this state directory
        ended = self.replicas.shutdown(f"the gateway is shutting down: this request was still running when the "
                                        f"{grace_s:g} s drain period ended; retry it")
        if ended:
            log.warning("drain: %d requests still running after %g s were ended with an error event", ended, grace_s)
        flush_deadline = loop.time() + FLUSH_AFTER_DRAIN_S
        while self.open_streams and loop.time() < flush_deadline:
            await asyncio.sleep(0.02)
        for ws in list(self.websockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the gateway is shutting down")


def _log_access(seq: Request) -> None:
    """The access log's line for one generation request, when it ends: where it ran (its pipeline, and how often it
    moved), how it ended, its sizes and time."""
    access_log.info("request %s pipeline=%s handoffs=%d replays=%d finish=%s prompt_tokens=%d cached_tokens=%d "
                    "output_tokens=%d duration_ms=%.0f", seq.seq_id, seq.pipeline, seq.handoffs, seq.replays,
                    seq.finish_reason or "open", len(seq.prompt_ids), seq.cached_tokens, len(seq.output_ids),
                    (time.perf_counter() - seq.times.arrival) * 1e3)


GATEWAY = web.AppKey("gateway", Gateway)
