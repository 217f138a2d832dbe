"""A real browser (Debian's headless Chromium, driven over the DevTools protocol) uses the chat page."""

import asyncio
import base64
import itertools
import os
import shutil
import subprocess
import tempfile

import aiohttp
import pytest

from services.launch import free_port, start_up

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_up(2, "bfloat16", str(tmp_path_factory.mktemp("gwbrowser")))
    yield gw
    gw.stop()


@pytest.fixture
def chromium():
    assert os.path.exists(CHROMIUM), "chromium is missing: `make test` installs Debian's chromium package"
    port = free_port()
    profile = tempfile.mkdtemp(prefix="chromium-")
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={profile}", f"--remote-debugging-port={port}", "--window-size=900,700",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield port
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(profile, ignore_errors=True)


class DevTools:
    def __init__(self, ws):
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method, **params):
        mid = next(self.ids)
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=30)
            if msg.get("id") == mid:
                assert "error" not in msg, msg
                return msg["result"]

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


async def test_chat_page_streams_text_in_a_real_browser(gateway, chromium, output_dir):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await dt.call("Page.enable")
            await dt.call("Page.navigate", url=gateway.url + "/")
            for _ in range(100):
                if await dt.js("document.readyState === 'complete' && !document.getElementById('send').disabled"):
                    break
                await asyncio.sleep(0.1)
            assert await dt.js("document.getElementById('status').textContent") == "connected"
            await dt.js("document.getElementById('prompt').value = 'Tell me about the ocean in three sentences.';"
                        "document.getElementById('send').click(); true")
            snapshots = []
            for _ in range(300):
                text = await dt.js("(document.querySelector('.assistant') || {}).textContent || ''")
                if text and (not snapshots or text != snapshots[-1]):
                    snapshots.append(text)
                if await dt.js("document.getElementById('stop').disabled && !!document.querySelector('.assistant')"):
                    break
                await asyncio.sleep(0.05)
            stats = await dt.js("document.getElementById('stats').textContent")
            shot = await dt.call("Page.captureScreenshot", format="png")
    path = os.path.join(output_dir, "browser-chat.png")
    with open(path, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    assert len(snapshots) >= 3, snapshots  # the text grew in several steps: it streamed
    assert all(b.startswith(a) for a, b in zip(snapshots, snapshots[1:]))
    assert len(snapshots[-1]) > 20
    assert "tokens/s" in stats
    assert os.path.getsize(path) > 5000
