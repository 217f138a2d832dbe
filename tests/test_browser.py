"""A real browser (Debian's headless Chromium, driven over the DevTools protocol) uses the chat page of a real
`stagemesh up` in API key mode with a small context: the key asked once, markdown, the context limit, reload,
settings, phone width; code highlighting, copy, edit, regenerate and continue with the versions they keep, dark
mode, rename, search, export and import of conversations. Screenshots go to tests/output/browser/ (committed, to
be looked at)."""

import asyncio
import base64
import itertools
import json
import os
import re

import aiohttp
import pytest

from tests.conftest import shares_up

SHOTS = os.path.join(os.path.dirname(__file__), "output", "browser")
API_KEY = "browser-test-key-7"
CONTEXT = 320  # tokens: a few turns fill it, so the page meets the limit quickly


# chromium (a headless Chromium's DevTools port) is tests/conftest.py's, as test_mesh_view uses it too


@pytest.fixture(scope="module")
@shares_up
def gateway(up):
    return up("--max-seq-len", str(CONTEXT), stages=2, dtype="bfloat16", api_key=API_KEY)


@pytest.fixture(scope="module")
@shares_up
def plain(up):
    """A gateway that serves no chat template (`--chat-template none`, as a base model's file has none)."""
    return up("--chat-template", "none", "--max-seq-len", str(CONTEXT))


class DevTools:
    def __init__(self, ws):
        self.ws, self.ids = ws, itertools.count(1)
        self.events: list[dict] = []  # every event seen while waiting for an answer (console, CSP reports, ...)

    async def call(self, method, **params):
        mid = next(self.ids)
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=30)
            if msg.get("id") == mid:
                assert "error" not in msg, msg
                return msg["result"]
            if "method" in msg:
                self.events.append(msg)

    async def js(self, expression):
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return r["result"].get("value")


async def page_ws_url(session: aiohttp.ClientSession, port: int) -> str:
    """The DevTools websocket of the browser's first page, once Chromium lists it."""
    for _ in range(100):
        try:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in await r.json() if t["type"] == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("chromium never listed a page")




async def wait_js(dt: DevTools, expression: str, timeout: float, what: str):
    for _ in range(int(timeout / 0.1)):
        value = await dt.js(expression)
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}: {expression}")


async def screenshot(dt: DevTools, name: str) -> str:
    os.makedirs(SHOTS, exist_ok=True)
    shot = await dt.call("Page.captureScreenshot", format="png")
    path = os.path.join(SHOTS, name)
    with open(path, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    assert os.path.getsize(path) > 5000
    return path


async def open_chat(dt: DevTools, url: str, enter_key: bool = True) -> None:
    """Navigate to the page; when it asks for the API key, give it; return once the websocket is connected."""
    await dt.call("Page.enable")
    await dt.call("Log.enable")
    await dt.call("Runtime.enable")
    await dt.call("Page.navigate", url=url + "/")
    state = await wait_js(dt, "document.readyState === 'complete' && (!document.getElementById('key-form').hidden"
                              " ? 'key' : document.getElementById('status').textContent === 'connected' && 'ok')",
                          30, "the page to connect or ask for the key")
    if state == "key" and enter_key:
        await dt.js(f"document.getElementById('api-key').value = {json.dumps(API_KEY)};"
                    "document.getElementById('key-form').requestSubmit(); true")
        await wait_js(dt, "document.getElementById('status').textContent === 'connected'", 30, "the websocket")


async def save_settings(dt: DevTools, **values) -> None:
    """Fill the settings panel as a user would (ids set-system, set-temperature, set-top-p, set-max-tokens)."""
    await dt.js("document.getElementById('open-settings').click(); true")
    for name, value in values.items():
        await dt.js(f"document.getElementById('set-{name.replace('_', '-')}').value = {json.dumps(str(value))}; true")
    await dt.js("document.getElementById('save-settings').click(); true")
    assert await dt.js("document.getElementById('settings').hidden"), await dt.js(
        "document.getElementById('settings-note').textContent")


async def send(dt: DevTools, text: str, timeout: float = 240) -> list[str]:
    """Type and send with Enter (a real key event); wait for the answer to end. Returns the answer's text as it
    was seen growing."""
    await dt.js(f"document.getElementById('prompt').value = {json.dumps(text)}; document.getElementById('prompt').focus(); true")
    await dt.call("Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter", windowsVirtualKeyCode=13, text="\r")
    await dt.call("Input.dispatchKeyEvent", type="keyUp", key="Enter", code="Enter", windowsVirtualKeyCode=13)
    await wait_js(dt, "!document.getElementById('stop').disabled || !!document.getElementById('context-notice')", 10,
                  "the generation to start")
    seen = []
    for _ in range(int(timeout / 0.05)):
        text = await dt.js("[...document.querySelectorAll('.assistant .body')].map((e) => e.textContent).pop() || ''")
        if text and (not seen or text != seen[-1]):
            seen.append(text)
        if await dt.js("document.getElementById('stop').disabled"):
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"no end of the answer to {text!r} within {timeout} s")


def csp_violations(dt: DevTools) -> list[str]:
    texts = [json.dumps(e["params"]) for e in dt.events
             if e["method"] in ("Log.entryAdded", "Runtime.consoleAPICalled", "Runtime.exceptionThrown")]
    return [t for t in texts if "Content Security Policy" in t or "exceptionDetails" in t]


async def test_static_files_and_csp(gateway):
    async with aiohttp.ClientSession() as s:
        async with s.get(gateway.url + "/") as r:
            csp = r.headers["Content-Security-Policy"]
            page = await r.text()
        assert "script-src 'self'" in csp and "unsafe" not in csp
        assert "<script>" not in page and "<style>" not in page  # nothing inline: the policy allows none
        js = ("text/javascript", "application/javascript")  # both are JavaScript MIME types to a browser
        css = ("text/css",)
        for path, ctypes in [("/static/vendor/marked-15.0.12.min.js", js), ("/static/vendor/purify-3.2.6.min.js", js),
                             ("/static/vendor/highlight-11.11.1.min.js", js),
                             ("/static/vendor/hljs-github-11.11.1.min.css", css),
                             ("/static/vendor/hljs-github-dark-11.11.1.min.css", css),
                             ("/static/chat.js", js), ("/static/mesh.js", js), ("/static/chat.css", css)]:
            assert f'"{path}"' in page
            async with s.get(gateway.url + path) as r:
                assert r.status == 200 and r.headers["Content-Type"].split(";")[0] in ctypes, (path, r.headers)
        async with s.get(gateway.url + "/static/../app.py") as r:
            assert r.status in (403, 404)


async def test_key_asked_once_markdown_renders_and_reload_keeps_conversation_and_settings(gateway, chromium):
    async with aiohttp.ClientSession() as s:
        async with s.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            model_id = (await r.json())["data"][0]["id"]
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await open_chat(dt, gateway.url, enter_key=False)
            assert not await dt.js("document.getElementById('key-form').hidden")  # API key mode: the page asks
            assert await dt.js("document.getElementById('send').disabled")
            await screenshot(dt, "key-asked.png")
            await dt.js(f"document.getElementById('api-key').value = {json.dumps(API_KEY)};"
                        "document.getElementById('key-form').requestSubmit(); true")
            await wait_js(dt, "document.getElementById('status').textContent === 'connected'", 30, "the websocket")
            assert await dt.js("localStorage.getItem('stagemesh.apiKey')") == API_KEY
            assert await dt.js("document.getElementById('model').textContent") == model_id
            assert await dt.js("document.getElementById('ctx').textContent") == f"context 0 / {CONTEXT}"

            await save_settings(dt, temperature=0, top_p=0.9, max_tokens=150, system="You are a concise assistant.")
            seen = await send(dt, "Show a Python function that adds two numbers, in a markdown code block, "
                                  "and put the most important word in **bold**.")
            assert len(seen) >= 3 and len(seen[-1]) > 20, seen  # it streamed, in several steps
            stats = await dt.js("document.getElementById('stats').textContent")
            assert "tokens/s" in stats, stats
            html = await dt.js("document.querySelector('.assistant .body').innerHTML")
            assert "<pre" in html or "<strong>" in html, html  # markdown rendered, not shown raw
            assert "```" not in await dt.js("document.querySelector('.assistant .body').textContent")
            if "<pre" in html:  # its Copy button puts the code (without the button's own label) on the clipboard
                await dt.call("Browser.grantPermissions", permissions=["clipboardReadWrite", "clipboardSanitizedWrite"])
                await dt.js("document.querySelector('.assistant pre button.copy').click(); true")
                await wait_js(dt, "document.querySelector('.assistant pre button.copy').textContent === 'Copied'", 5,
                              "the copy")
                code = await dt.js("document.querySelector('.assistant pre code').textContent")
                assert await dt.js("navigator.clipboard.readText()") == code and "Copy" not in code
            # Stop, disabled after the answer, looks it: not the red of an active Stop
            assert await dt.js("getComputedStyle(document.getElementById('stop')).backgroundColor") != "rgb(220, 38, 38)"
            used = await dt.js("document.getElementById('ctx').textContent")
            assert used.startswith("context ") and 0 < int(used.split()[1]) <= CONTEXT, used
            await screenshot(dt, "chat-markdown.png")
            log_text = ("(() => { const c = document.getElementById('log').cloneNode(true);"
                        "c.querySelectorAll('button.copy').forEach((b) => b.remove()); return c.textContent; })()")
            before = await dt.js(log_text)

            await dt.call("Page.reload")
            await wait_js(dt, "document.readyState === 'complete' && "
                              "document.getElementById('status').textContent === 'connected'", 30, "reconnect")
            assert await dt.js("document.getElementById('key-form').hidden")  # the key was kept: not asked again
            assert await dt.js(log_text) == before
            assert await dt.js("document.querySelectorAll('#conversations li').length") == 1
            await dt.js("document.getElementById('open-settings').click(); true")
            assert await dt.js("[document.getElementById('set-temperature').value, document.getElementById('set-top-p')"
                               ".value, document.getElementById('set-max-tokens').value, "
                               "document.getElementById('set-system').value]") == \
                ["0", "0.9", "150", "You are a concise assistant."]
            await dt.js("document.getElementById('open-settings').click(); true")

            await dt.js("document.getElementById('new-chat').click(); true")  # a new chat: empty, the old one listed
            assert await dt.js("document.getElementById('log').children.length") == 0
            # Stop: active (red) while an answer streams; a click ends it, the partial answer kept
            await dt.js("document.getElementById('prompt').value = 'Write a long story about a dragon and a knight.';"
                        "document.getElementById('send').click(); true")
            await wait_js(dt, "(document.querySelector('.assistant .body') || {}).textContent.length > 10", 60,
                          "a few tokens")
            assert await dt.js("getComputedStyle(document.getElementById('stop')).backgroundColor") == "rgb(220, 38, 38)"
            await dt.js("document.getElementById('stop').click(); true")
            await wait_js(dt, "document.getElementById('stop').disabled", 30, "the stopped answer")
            assert (await dt.js("document.getElementById('stats').textContent")).endswith("stopped")
            kept = await dt.js("conv.messages")
            assert [m["role"] for m in kept] == ["user", "assistant"] and len(kept[1]["content"]) > 10, kept
            assert await dt.js("document.querySelectorAll('#conversations li').length") == 2
            await screenshot(dt, "chat-two-conversations.png")
            # the mesh view's EventSource carries the kept key too (it cannot send a header)
            await dt.js("location.hash = '#mesh'; true")
            await wait_js(dt, "document.getElementById('mesh-verdict').textContent === 'ready' && "
                              "!!document.getElementById('stage-1')", 30, "the mesh view in API key mode")
            stage = await dt.js("document.getElementById('stage-1').textContent")  # its prefix rows' K/V, of the bound
            assert re.search(r"cached prefixes\d+ prefix(es)? · [\d,]+ MiB of [1-9][\d,]* MiB KV", stage), stage
            assert re.search(r"KV slots\d+ of \d+ in use", stage), stage
            # the charts have axes: 0 to the window's largest value, from the oldest point to now
            await wait_js(dt, "/^−\\d+ (s|min)$/.test(document.querySelector('#chart-tokens_per_s .x-start')"
                              ".textContent)", 10, "two points of the charts' history")
            axes = await dt.js("[...document.querySelectorAll('#chart-running .y-axis span, #chart-running .x-axis "
                               "span')].map((e) => e.textContent)")
            assert len(axes) == 5 and axes[1] == "0" and axes[3:] == ["time", "now"], axes
            assert re.fullmatch(r"−\d+ (s|min)", axes[2]) and float(axes[0].replace(",", "")) >= 0, axes
            assert not csp_violations(dt), csp_violations(dt)


async def test_long_conversation_continues_past_the_context_limit(gateway, chromium):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await open_chat(dt, gateway.url)
            await save_settings(dt, temperature=0, max_tokens=64)
            notice = False
            for i in range(12):
                await send(dt, f"Tell me one interesting fact about the number {i + 7}.")
                if await dt.js("!!document.getElementById('context-notice')"):
                    notice = True
                    break
            assert notice, "the context never filled"
            text = await dt.js("document.getElementById('context-notice').textContent")
            assert f"{CONTEXT} tokens" in text, text
            await screenshot(dt, "context-full.png")
            count = await dt.js("conv.messages.length")
            await drop_oldest(dt)
            assert not await dt.js("!!document.getElementById('context-notice')")
            assert await dt.js("conv.messages.length") <= count + 1
            last = await dt.js("conv.messages[conv.messages.length - 1]")
            assert last["role"] == "assistant" and last["content"].strip(), last
            # the conversation goes on: one more turn after the drop (the answers may fill the context again: then
            # the page offers the same way on, and it works again)
            await send(dt, "Thanks! One more, about the number 3.")
            if await dt.js("!!document.getElementById('context-notice')"):
                await drop_oldest(dt)
            assert not await dt.js("!!document.getElementById('context-notice')")
            last = await dt.js("conv.messages[conv.messages.length - 1]")
            assert last["role"] == "assistant" and last["content"].strip(), last
            await screenshot(dt, "context-continued.png")


async def drop_oldest(dt: DevTools) -> None:
    """Press the context notice's button: drop the oldest exchange, and resend the refused message where the button
    says it retries (else send another one); wait for the answer."""
    retries = await dt.js("document.getElementById('drop-oldest').textContent.includes('retry')")
    await dt.js("document.getElementById('drop-oldest').click(); true")
    if retries:  # the refused message is sent again at once
        await wait_js(dt, "document.getElementById('stop').disabled", 240, "the retried answer")
    else:
        await send(dt, "And one more fact, please.")


async def test_a_model_without_a_chat_template_completes_text_on_the_page(plain, chromium):
    """A gateway that serves no chat template (`--chat-template none`, as a base model's file has none): /v1/models
    lists no "chat", and the page says it completes text, sends the conversation as one prompt and shows the
    continuation (a chat request there would be refused, and the page would show that error instead)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(plain.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["capabilities"] == ["completion"]
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await open_chat(dt, plain.url)
            await wait_js(dt, "!document.getElementById('mode-note').hidden", 10, "the completion notice")
            assert "no chat template" in await dt.js("document.getElementById('mode-note').textContent")
            assert "start of a text" in await dt.js("document.getElementById('prompt').placeholder")
            await save_settings(dt, temperature=0, max_tokens=12)
            seen = await send(dt, "Once upon a time, in a small village by the sea,")
            assert seen and seen[-1].strip(), seen
            assert not await dt.js("!!document.querySelector('.msg.error')"), await dt.js(
                "document.querySelector('.msg.error').textContent")
            first = await dt.js("conv.messages[1].content")
            # the next turn continues the whole text: what was written, the model's words, and the new words
            seen = await send(dt, " The end.")
            assert seen and seen[-1].strip() and await dt.js("conv.messages.length") == 4
            assert await dt.js("conv.messages[1].content") == first
            await screenshot(dt, "completion-mode.png")
            # chat is not the default here, and choosing it is sent as chat: the gateway refuses it, visibly
            await save_settings(dt, mode="chat")
            assert await dt.js("document.getElementById('mode-note').hidden")
            await dt.js("document.getElementById('prompt').value = 'Hello?'; document.getElementById('send').click(); true")
            error = await wait_js(dt, "document.querySelector('.msg.error') && "
                                      "document.querySelector('.msg.error').textContent", 30, "chat to be refused")
            assert "no chat template" in error and "/root" not in error, error


@pytest.mark.reference  # the real Gemma 3 270M file comes with the reference packages (make install-reference)
async def test_gemma3_270m_whose_file_has_no_chat_template_chats_on_the_page(gemma_gateway, chromium):
    """The documented second model: its GGUF carries no chat template, the gateway uses its family's (Gemma's turns),
    /v1/models says it chats, and the page chats with it -- no completion notice, an answer without turn markers.
    (The up test_openai_api's Gemma test shares: the suite runs the two modules' Gemma tests one after the other.)"""
    await _gemma_chats(gemma_gateway, chromium)


async def _gemma_chats(gemma, chromium) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(gemma.url + "/v1/models") as r:
            assert "chat" in (await r.json())["data"][0]["capabilities"]
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await open_chat(dt, gemma.url)
            await save_settings(dt, temperature=0, max_tokens=16)
            assert await dt.js("document.getElementById('mode-note').hidden")
            seen = await send(dt, "What colour is the sky? Answer in one word.")
            assert seen and seen[-1].strip(), seen
            assert not await dt.js("!!document.querySelector('.msg.error')"), await dt.js(
                "document.querySelector('.msg.error').textContent")
            answer = await dt.js("conv.messages[1].content")
            assert answer.strip() and "<start_of_turn>" not in answer and "<end_of_turn>" not in answer, answer
            await screenshot(dt, "gemma3-chat.png")


async def test_phone_width_has_no_horizontal_scroll(gateway, chromium):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await dt.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=True)
            await open_chat(dt, gateway.url)
            await save_settings(dt, temperature=0, max_tokens=80)
            await send(dt, "Write a one-line shell command that counts the lines of every .py file in a directory, "
                           "in a code block.")
            widths = await dt.js("[document.documentElement.scrollWidth, document.documentElement.clientWidth, "
                                 "innerWidth]")
            assert widths[0] <= widths[1] <= 390, widths
            assert await dt.js("document.getElementById('send').getBoundingClientRect().right") <= 390
            await screenshot(dt, "phone.png")
            await dt.js("document.getElementById('toggle-sidebar').click(); true")
            await asyncio.sleep(0.4)
            assert await dt.js("document.getElementById('sidebar').getBoundingClientRect().left") >= 0
            assert await dt.js("document.documentElement.scrollWidth") <= 390
            await screenshot(dt, "phone-conversations.png")

            # what localStorage holds may be junk (an older page, a hand edit): the page still opens and works
            await dt.js("localStorage.setItem('stagemesh.settings', '{\"temperature\": \"hot\", \"top_p\": 7}');"
                        "localStorage.setItem('stagemesh.conversations', '[{\"id\": 1}, {\"id\": \"x\", "
                        "\"messages\": [{\"role\": \"user\", \"content\": 3}]}, \"text\"]'); true")
            await dt.call("Page.reload")
            await wait_js(dt, "document.readyState === 'complete' && "
                              "document.getElementById('status').textContent === 'connected'", 30, "reconnect")
            assert await dt.js("document.querySelectorAll('#conversations li').length") == 0
            assert await dt.js("[settings.temperature, settings.top_p]") == [0.7, 0.95]
            seen = await send(dt, "Say hi.")
            assert seen and seen[-1].strip()
            assert not csp_violations(dt), csp_violations(dt)
            # an answer that carries HTML renders through DOMPurify: markup kept, script handlers gone (the policy
            # would block an inline handler too: Chromium reports one blocked while the hostile text is parsed)
            html = await dt.js("(() => { const d = document.createElement('div'); renderMarkdown(d, '**bold** "
                               "<img src=x onerror=\"window.pwned=1\"><script>window.pwned=2</script>\\n\\n```\\nx = 1\\n```'); "
                               "document.body.appendChild(d); window.rendered = d; return d.innerHTML; })()")
            # the img (src=x) fails to load: once its error event has been dispatched, an onerror the sanitizer
            # left would have run (a broken image is `complete` only after that event's task)
            assert await dt.js("new Promise(done => { const img = window.rendered.querySelector('img'); "
                               "if (!img || img.complete) return done(!!img); "
                               "img.addEventListener('error', () => done(true)); "
                               "img.addEventListener('load', () => done(true)); setTimeout(() => done(false), 10000); })"), html
            assert "<strong>bold</strong>" in html and "onerror" not in html and "<script" not in html, html
            # a fence is a code block, always (its text highlighted: in token spans)
            assert re.search(r"<pre><code[^>]*>x = 1", re.sub(r"</?span[^>]*>", "", html), re.S), html
            assert await dt.js("window.pwned === undefined")


def sent_generates(dt: DevTools) -> list[dict]:
    """The `generate` messages the page sent on its websocket, oldest first (needs Network.enable)."""
    frames = [json.loads(e["params"]["response"]["payloadData"]) for e in dt.events
              if e["method"] == "Network.webSocketFrameSent"]
    return [f for f in frames if f.get("type") == "generate"]


async def wait_answer(dt: DevTools, what: str, timeout: float = 240) -> None:
    await wait_js(dt, "!document.getElementById('stop').disabled", 10, f"{what} to start")
    await wait_js(dt, "document.getElementById('stop').disabled", timeout, f"{what} to end")


async def click(dt: DevTools, selector: str) -> None:
    assert await dt.js(f"(() => {{ const b = document.querySelector({json.dumps(selector)}); "
                       "if (!b || b.disabled) return false; b.click(); return true; })()"), f"no enabled {selector}"


async def choose_file(dt: DevTools, path: str) -> None:
    """Pick a file in the page's import dialog, as a user's choice does (input and change events)."""
    node = await dt.call("Runtime.evaluate", expression="document.getElementById('import-file')")
    await dt.call("DOM.setFileInputFiles", files=[path], objectId=node["result"]["objectId"])


SHOWN_TEXT = "[...document.querySelectorAll('#log .msg .body')].map((e) => e.textContent)"
BODY_BG = "getComputedStyle(document.body).backgroundColor"
KEYWORD_COLOUR = "getComputedStyle(document.querySelector('#log code .hljs-keyword')).color"


async def test_versions_copy_dark_mode_export_and_import(gateway, chromium, tmp_path):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await dt.call("Network.enable")  # the websocket frames the page sends are recorded in dt.events
            await open_chat(dt, gateway.url)

            # the sampler settings say what a request sends, and what the API would use without them
            await dt.js("document.getElementById('open-settings').click(); true")
            assert await dt.js("document.getElementById('hint-temperature').textContent") == \
                "page default 0.7 (the API's: 1)"
            assert await dt.js("document.getElementById('hint-max-tokens').textContent") == \
                "auto: 1,024, or what the context has left"
            auto = min(1024, CONTEXT)  # a new conversation: the whole context is left
            assert await dt.js("document.getElementById('set-effective').textContent") == \
                f"Each request sends: temperature 0.7 · top-p 0.95 · max tokens {auto} (auto)"
            await dt.js("document.getElementById('set-max-tokens').value = '40';"
                        "document.getElementById('set-max-tokens').dispatchEvent(new Event('input')); true")
            assert (await dt.js("document.getElementById('set-effective').textContent")).endswith("max tokens 40")
            await dt.js("document.getElementById('open-settings').click(); true")  # closed unsaved: auto stays
            # "auto" sends the cap; the prompt leaves less room in this small context, so the page asks again
            # without it (up to the end of the context)
            seen = await send(dt, "Say hi.")
            assert seen and seen[-1].strip()
            first, retried = sent_generates(dt)[-2:]
            assert (first["temperature"], first["top_p"], first["max_tokens"]) == (0.7, 0.95, auto), first
            assert "max_tokens" not in retried and retried["messages"] == first["messages"], retried

            # an answer cut at max_tokens can be continued: the same answer grows
            await dt.js("document.getElementById('new-chat').click(); true")
            await save_settings(dt, temperature=0, max_tokens=8)
            story = "Write a long story about a dragon who learns to bake bread."
            await send(dt, story)
            assert "token limit" in await dt.js("document.getElementById('stats').textContent")
            cut = await dt.js("conv.messages[1].content")
            await click(dt, ".msg.assistant .continue")
            await wait_answer(dt, "the continued answer")
            assert sent_generates(dt)[-1].get("continue_final_message") is True
            assert sent_generates(dt)[-1]["messages"][-1] == {"role": "assistant", "content": cut}
            grown = await dt.js("conv.messages")
            assert len(grown) == 2 and grown[1]["content"].startswith(cut) and len(grown[1]["content"]) > len(cut), grown

            # regenerate: a second answer; the first stays as version 1 of 2
            await save_settings(dt, temperature=0, max_tokens=30)
            await click(dt, ".msg.assistant .regenerate")
            await wait_answer(dt, "the regenerated answer")
            second = await dt.js("conv.messages[1].content")
            assert second != grown[1]["content"] and await dt.js("conv.messages.length") == 2
            assert await dt.js("document.querySelector('.msg.assistant .branch-label').textContent") == "2/2"
            await click(dt, ".msg.assistant .prev-branch")
            assert await dt.js("[conv.messages[1].content, document.querySelector('.msg.assistant .branch-label')"
                               ".textContent]") == [grown[1]["content"], "1/2"]
            shown_first = await dt.js(SHOWN_TEXT)
            await click(dt, ".msg.assistant .next-branch")
            assert await dt.js("conv.messages[1].content") == second and await dt.js(SHOWN_TEXT) != shown_first

            # Copy under a message puts that message's text on the clipboard
            await dt.call("Browser.grantPermissions", permissions=["clipboardReadWrite", "clipboardSanitizedWrite"])
            await click(dt, ".msg.assistant .copy-msg")
            await wait_js(dt, "document.querySelector('.msg.assistant .copy-msg').textContent === 'Copied'", 5, "copy")
            assert await dt.js("navigator.clipboard.readText()") == second

            # edit the question: it is sent again from there, with a new answer; the old question and its two
            # answers stay reachable as version 1
            await click(dt, ".msg.user .edit")
            await dt.js("document.querySelector('.edit-box').value = 'Name three colours.'; true")
            await click(dt, ".save-edit")
            await wait_answer(dt, "the answer to the edited question")
            assert sent_generates(dt)[-1]["messages"] == [{"role": "user", "content": "Name three colours."}]
            now = await dt.js("conv.messages")
            assert [m["role"] for m in now] == ["user", "assistant"] and now[1]["content"].strip(), now
            assert now[0]["content"] == "Name three colours." and now[1]["content"] not in (second, grown[1]["content"])
            assert await dt.js("document.querySelector('.msg.user .branch-label').textContent") == "2/2"
            await screenshot(dt, "chat-versions.png")
            await click(dt, ".msg.user .prev-branch")
            assert await dt.js("[conv.messages[0].content, conv.messages[1].content]") == [story, second]
            assert await dt.js("document.querySelector('.msg.assistant .branch-label').textContent") == "2/2"

            # rename and search the conversation list
            await click(dt, "#conversations li.active .rename")
            await dt.js("document.querySelector('#conversations input.rename').value = 'Dragon bakery'; true")
            await dt.call("Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter", windowsVirtualKeyCode=13)
            titles = "[...document.querySelectorAll('#conversations .title')].map((e) => e.textContent)"
            assert await dt.js(titles) == ["Dragon bakery", "Say hi."]
            search = ("((q) => { const s = document.getElementById('search'); s.value = q;"
                      "s.dispatchEvent(new Event('input')); return " + titles + "; })")
            assert await dt.js(search + "('BREAD')") == ["Dragon bakery"]  # the text of a kept version counts too
            assert await dt.js(search + "('no such words')") == []
            assert await dt.js("document.getElementById('conv-note').textContent") == "no conversation matches"
            assert await dt.js(search + "('')") == ["Dragon bakery", "Say hi."]

            # export all: a JSON file holding both conversations, versions included
            downloads = tmp_path / "downloads"
            downloads.mkdir()
            await dt.call("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(downloads))
            await click(dt, "#export-all")
            for _ in range(100):
                files = [f for f in downloads.iterdir() if f.suffix == ".json"]
                if files:
                    break
                await asyncio.sleep(0.1)
            assert len(files) == 1, list(downloads.iterdir())
            exported = json.loads(files[0].read_text())
            stored = await dt.js("JSON.parse(localStorage.getItem('stagemesh.conversations'))")
            assert exported["kind"] == "stagemesh.conversations" and len(exported["conversations"]) == 2
            assert [(c["id"], c["title"], c["messages"]) for c in exported["conversations"]] == \
                [(c["id"], c["title"], c["messages"]) for c in stored]
            assert exported["conversations"][0]["messages"][0]["alts"][1][0]["content"] == "Name three colours."

            # import: a bad file changes nothing and says why; the export brings both conversations back
            bad = tmp_path / "bad.json"
            for text, why in [("not json", "not JSON"), ('{"kind": "stagemesh.conversations", "conversations": '
                                                         '[{"id": "x", "messages": [{"role": "robot", "content": 1}]}]}',
                                                         "conversation 1 of the file is malformed")]:
                bad.write_text(text)
                await choose_file(dt, str(bad))
                note = await wait_js(dt, "document.getElementById('conv-note').textContent", 5, "the import's note")
                assert note.startswith("Import failed, nothing changed") and why in note, note
                assert await dt.js("JSON.parse(localStorage.getItem('stagemesh.conversations')).length") == 2
                await dt.js("document.getElementById('conv-note').textContent = ''; true")
            await click(dt, "#conversations li:not(.active) .del")
            await click(dt, "#conversations li.active .del")
            assert await dt.js(titles) == []
            await choose_file(dt, str(files[0]))
            await wait_js(dt, "document.getElementById('conv-note').textContent === 'imported 2 conversations'", 5,
                          "the import")
            back = await dt.js("JSON.parse(localStorage.getItem('stagemesh.conversations'))")
            assert [(c["id"], c["title"], c["messages"]) for c in back] == \
                [(c["id"], c["title"], c["messages"]) for c in stored]
            await choose_file(dt, str(files[0]))  # again: nothing doubled
            await wait_js(dt, "document.getElementById('conv-note').textContent.includes('2 already here')", 5,
                          "the second import")
            assert await dt.js(titles) == ["Dragon bakery", "Say hi."]

            # code is highlighted (tokens in spans), and a code block's text stays text: no markup gets through
            code_chat = tmp_path / "code.json"
            hostile = '<img src=x onerror="window.pwned=1">'
            code_chat.write_text(json.dumps([{"id": "code1", "title": "Code", "updated": 4e12, "messages": [
                {"role": "user", "content": "Add two numbers in Python; and show an img tag."},
                {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```\n\n"
                                                 f"```html\n{hostile}\n```"}]}]))
            await choose_file(dt, str(code_chat))
            await wait_js(dt, "document.getElementById('conv-note').textContent === 'imported 1 conversation'", 5,
                          "the code import")
            await dt.js("document.querySelector('#conversations li[data-id=code1] .title').click(); true")
            assert await dt.js("document.querySelector('#log code .hljs-keyword').textContent") == "def"
            assert await dt.js("document.querySelector('#log code').textContent") == "def add(a, b):\n    return a + b\n"
            assert await dt.js("document.querySelectorAll('#log code')[1].textContent") == hostile + "\n"
            assert await dt.js("document.querySelectorAll('#log img').length") == 0
            await asyncio.sleep(0.2)
            assert await dt.js("window.pwned === undefined")

            # dark mode follows the system; a choice in the settings overrides it and is kept
            light_bg, light_kw = await dt.js(f"[{BODY_BG}, {KEYWORD_COLOUR}]")
            assert light_bg == "rgb(247, 248, 250)", light_bg
            await dt.call("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": "dark"}])
            await wait_js(dt, f"{BODY_BG} === 'rgb(11, 15, 23)'", 5, "the dark theme")
            assert await dt.js(KEYWORD_COLOUR) not in (light_kw, None)  # the code's dark colours too
            await screenshot(dt, "dark.png")
            choose_theme = ("((v) => { const t = document.getElementById('set-theme'); t.value = v;"
                            "t.dispatchEvent(new Event('change')); return getComputedStyle(document.body)"
                            ".backgroundColor; })")
            assert await dt.js(choose_theme + "('light')") == light_bg
            await dt.call("Page.reload")
            await wait_js(dt, "document.readyState === 'complete' && "
                              "document.getElementById('status').textContent === 'connected'", 30, "reconnect")
            assert await dt.js(f"[{BODY_BG}, {KEYWORD_COLOUR}]") == [light_bg, light_kw]  # kept, the system dark
            assert await dt.js(choose_theme + "('auto')") == "rgb(11, 15, 23)"
            assert await dt.js("localStorage.getItem('stagemesh.theme')") is None
            assert not csp_violations(dt), csp_violations(dt)
