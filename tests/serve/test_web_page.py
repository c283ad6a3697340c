"""The chat page at ``/`` in a real headless browser (Debian chromium driven by playwright)
against a live ``olmoflow serve`` app on the tiny test model.

What the page shows is compared with what the API answers for the same request (greedy), so the
browser's fetch + SSE parsing, the settings panel and the history it keeps are all checked end to
end. A screenshot is saved to ``$OLMOFLOW_SCREENSHOT_DIR`` (or the test's ``tmp_path``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WEB_DIR = Path(__file__).resolve().parents[2] / "src" / "olmoflow" / "serve" / "web"
TIMEOUT_MS = 20_000

if not os.path.exists(CHROMIUM):
    pytest.skip(f"Debian chromium is not installed at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the python playwright package is not installed")
expect = sync_api.expect
# Waits are for a reply on a busy 2-core machine, not a measure of speed.
expect.set_options(timeout=TIMEOUT_MS)

# Fetch wrapper installed before the page's own script. It never changes a byte, only how the
# bytes are handed over: window.__olmoChunk = n re-cuts every read into n-byte pieces (so JSON
# and UTF-8 characters are split across reads); window.__olmoHoldOnce = true delivers a reply's
# events up to the first one with text, then holds the rest until the page aborts the fetch
# (a reply that is still streaming when Stop is pressed, however fast the model is).
FETCH_WRAPPER = """
(() => {
  const realFetch = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const response = await realFetch(input, init);
    if (!String(input).includes("chat/completions") || !response.ok || !response.body) {
      return response;
    }
    const chunk = window.__olmoChunk || 0;
    const hold = Boolean(window.__olmoHoldOnce);
    window.__olmoHoldOnce = false;
    const signal = init && init.signal;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const encoder = new TextEncoder();
    let pending = [];
    let seen = "";
    let holding = false;
    const aborted = () => new Promise((resolve) => {
      if (signal.aborted) resolve();
      else signal.addEventListener("abort", resolve, { once: true });
    });
    const body = new ReadableStream({
      async pull(controller) {
        if (holding) {
          await aborted();
          controller.error(new DOMException("The user aborted a request.", "AbortError"));
          return;
        }
        while (!pending.length) {
          const { value, done } = await reader.read();
          if (done) { controller.close(); return; }
          if (hold) {
            seen += decoder.decode(value, { stream: true });
            const cut = seen.search(/"content":\\s*"[^"]/);
            if (cut >= 0) {
              const end = seen.indexOf("\\n\\n", cut);
              if (end >= 0) {
                pending.push(encoder.encode(seen.slice(0, end + 2)));
                holding = true;
                break;
              }
            }
            continue;
          }
          const step = chunk || value.length;
          for (let i = 0; i < value.length; i += step) pending.push(value.slice(i, i + step));
        }
        controller.enqueue(pending.shift());
      },
      cancel(reason) { return reader.cancel(reason); },
    });
    return new Response(body, { status: response.status, statusText: response.statusText,
                                headers: response.headers });
  };
})();
"""

# Chromium logs every non-2xx fetch as a console error; the bad-setting test expects one.
HTTP_ERROR_LOG = re.compile(r"Failed to load resource: the server responded with a status of 4\d\d")


# ---- browser and page ------------------------------------------------------------------
# The live server is conftest's ``base_url`` (shared, no API key); the API-key test starts its
# own keyed server with conftest's ``make_server``.


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for the module (each test opens its own context and page)."""
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A fresh browser context on the chat page, recording console errors and requests."""

    def __init__(self, browser, base_url: str, *, width: int = 1100, height: int = 760):
        self.base_url = base_url
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.context.add_init_script(FETCH_WRAPPER)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.chat_bodies: list[dict] = []
        self.chat_auth: list[str | None] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("request", self._request)

    def _console(self, msg) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)

    def _request(self, request) -> None:
        self.urls.append(request.url)
        if request.url.endswith("/v1/chat/completions"):
            self.chat_bodies.append(json.loads(request.post_data))
            self.chat_auth.append(request.headers.get("authorization"))

    def open(self) -> Page:
        self.page.goto(self.base_url + "/")
        expect(self.page.locator("#model-name")).not_to_have_text("loading…")
        return self

    def settings(self, **fields: str) -> None:
        """Open the settings panel and fill fields by their label."""
        details = self.page.locator("#settings")
        if details.get_attribute("open") is None:
            self.page.get_by_text("Settings", exact=True).click()
        labels = {"system": "System prompt", "temperature": "Temperature", "top_p": "Top p",
                  "max_tokens": "Max tokens", "seed": "Seed", "api_key": "API key"}
        for name, value in fields.items():
            self.page.get_by_label(labels[name]).fill(value)

    def close_settings(self) -> None:
        if self.page.locator("#settings").get_attribute("open") is not None:
            self.page.get_by_text("Settings", exact=True).click()

    def say(self, text: str) -> str:
        """Type ``text`` (newlines with Shift+Enter), press Enter, wait for the reply's end and
        return the last assistant bubble's text."""
        box = self.page.get_by_label("Message")
        box.click()
        for i, line in enumerate(text.split("\n")):
            if i:
                box.press("Shift+Enter")
            box.press_sequentially(line)
        expect(box).to_have_value(text)  # Shift+Enter made a newline, it did not send
        n = len(self.chat_bodies)
        answered = self.page.locator(".msg-assistant")
        before = answered.count()
        box.press("Enter")
        # A short reply may be over before a check for "busy" runs: wait for its bubble.
        expect(answered).to_have_count(before + 1)
        expect(self.page.locator(".msg-streaming")).to_have_count(0)
        expect(self.page.get_by_role("button", name="Send")).to_be_enabled()
        expect(box).to_have_value("")
        assert len(self.chat_bodies) == n + 1
        return self.replies()[-1]

    def replies(self) -> list[str]:
        return self.page.locator(".msg-assistant .msg-text").all_text_contents()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, base_url):
    p = Page(browser, base_url)
    yield p
    p.close()


def model_id(base_url: str, **headers: str) -> str:
    return httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def api_chat(base_url: str, messages: list[dict], **settings) -> str:
    """The assistant text the API returns for ``messages`` (not streamed)."""
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                   json={"model": model_id(base_url), "messages": messages, **settings})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def screenshot_dir(tmp_path: Path) -> Path:
    d = Path(os.environ.get("OLMOFLOW_SCREENSHOT_DIR") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---- tests ------------------------------------------------------------------------------


def test_page_is_self_contained():
    """Nothing in the page refers to another host (it works offline) and model text is never
    parsed as HTML."""
    for name in ("index.html", "app.js", "style.css"):
        text = (WEB_DIR / name).read_text(encoding="utf-8")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), name
        assert "@import" not in text and "url(http" not in text, name
    js = (WEB_DIR / "app.js").read_text(encoding="utf-8")
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js


def test_loads_without_errors_and_shows_model(page, base_url):
    page.open()
    expect(page.page.locator("#model-name")).to_have_text(model_id(base_url))
    # Every control has an accessible name.
    for label in ("System prompt", "Temperature", "Top p", "Max tokens", "Seed", "API key",
                  "Message"):
        expect(page.page.get_by_label(label)).to_have_count(1)
    for name in ("Send", "Stop", "New chat"):
        expect(page.page.get_by_role("button", name=name)).to_have_count(1)
    expect(page.page.get_by_role("button", name="Stop")).to_be_disabled()
    expect(page.page.get_by_role("log", name="Conversation")).to_be_visible()
    assert page.errors == []
    assert page.urls and all(u.startswith(base_url + "/") for u in page.urls), page.urls


def test_enter_streams_the_api_answer_and_keeps_history(page, base_url, tmp_path):
    page.open()
    # Every read is cut into 7-byte pieces: events, JSON and UTF-8 characters arrive split.
    page.page.evaluate("window.__olmoChunk = 7")
    settings = {"temperature": 0, "top_p": 1, "max_tokens": 24}
    page.settings(temperature="0", top_p="1", max_tokens="24")

    first = "Hello world!\nWhat is 2+2?"
    reply = page.say(first)
    history = [{"role": "user", "content": first}]
    assert reply == api_chat(base_url, history, **settings)
    assert reply
    body = page.chat_bodies[-1]
    assert body["messages"] == history and body["stream"] is True
    assert {k: body[k] for k in settings} == settings and "seed" not in body
    assert page.page.locator(".msg-user .msg-text").all_text_contents() == [first]

    # The second turn sends the whole conversation, the first reply included.
    second = "The cat sat on the mat. 😀"
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": second}]
    reply2 = page.say(second)
    assert reply2 == api_chat(base_url, history, **settings)
    assert page.chat_bodies[-1]["messages"] == history
    assert page.replies() == [reply, reply2]
    expect(page.page.get_by_role("alert")).to_be_hidden()

    page.close_settings()
    page.page.screenshot(path=str(screenshot_dir(tmp_path) / "serve_page.png"))
    assert page.errors == []


def test_system_prompt_is_sent(page, base_url):
    page.open()
    system = "user, assistant, system: be brief and helpful"
    page.settings(system=system, temperature="0", max_tokens="20", seed="3")
    reply = page.say("def add(a, b):")
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "def add(a, b):"}]
    assert page.chat_bodies[-1]["messages"] == messages
    assert page.chat_bodies[-1]["seed"] == 3
    assert reply == api_chat(base_url, messages, temperature=0, max_tokens=20, seed=3)
    assert page.errors == []


def test_stop_keeps_partial_reply_and_reenables_send(page, base_url):
    page.open()
    page.settings(temperature="0", max_tokens="40")
    prompt = "The quick brown fox"
    full = api_chat(base_url, [{"role": "user", "content": prompt}], temperature=0, max_tokens=40)
    # The first event with text is delivered, the rest held until the page aborts.
    page.page.evaluate("window.__olmoHoldOnce = true")
    box = page.page.get_by_label("Message")
    box.fill(prompt)
    box.press("Enter")
    send = page.page.get_by_role("button", name="Send")
    stop = page.page.get_by_role("button", name="Stop")
    expect(stop).to_be_enabled()
    expect(send).to_be_disabled()
    partial_text = page.page.locator(".msg-assistant .msg-text").last
    expect(partial_text).not_to_have_text("")
    stop.click()
    expect(send).to_be_enabled()
    expect(stop).to_be_disabled()
    expect(page.page.locator(".msg-assistant .msg-note").last).to_have_text("stopped")
    partial = page.replies()[-1]
    assert partial and full.startswith(partial) and len(partial) < len(full)

    # The partial reply is part of the conversation the next turn sends.
    nxt = "1, 2, 3"
    page.say(nxt)
    assert page.chat_bodies[-1]["messages"] == [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": partial},
        {"role": "user", "content": nxt}]

    # New chat while a reply streams: it is dropped, and the next turn starts afresh.
    page.page.evaluate("window.__olmoHoldOnce = true")
    box.fill(prompt)
    box.press("Enter")
    expect(partial_text).not_to_have_text("")
    page.page.get_by_role("button", name="New chat").click()
    expect(page.page.locator(".msg")).to_have_count(0)
    expect(send).to_be_enabled()
    page.say(nxt)
    assert page.chat_bodies[-1]["messages"] == [{"role": "user", "content": nxt}]
    expect(page.page.locator(".msg")).to_have_count(2)
    assert page.errors == []


def test_bad_setting_shows_the_server_error(page, base_url):
    page.open()
    page.settings(max_tokens="999999")
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=30,
                   json={"model": model_id(base_url), "stream": True, "temperature": 0.7,
                         "top_p": 1, "max_tokens": 999999,
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert 400 <= r.status_code < 500
    message = r.json()["error"]["message"]
    box = page.page.get_by_label("Message")
    box.fill("Hi")
    box.press("Enter")
    expect(page.page.get_by_role("alert")).to_have_text(message)
    expect(page.page.get_by_role("button", name="Send")).to_be_enabled()
    # The turn was not answered: it is given back to the message box, not kept in the history.
    expect(box).to_have_value("Hi")
    expect(page.page.locator(".msg")).to_have_count(0)
    assert page.errors and all(HTTP_ERROR_LOG.search(e) for e in page.errors), page.errors


@pytest.fixture(scope="module")
def keyed_url(tiny_model):
    """A second live server that needs ``Authorization: Bearer sk-web-test``."""
    from serving import make_server

    live = make_server(*tiny_model, api_key=KEY, max_batch=2, max_queue=4)
    try:
        yield live.url
    finally:
        live.close()


KEY = "sk-web-test"


def test_narrow_window_api_key_and_new_chat(browser, keyed_url):
    p = Page(browser, keyed_url, width=360, height=720)
    try:
        p.page.goto(keyed_url + "/")
        # Without the key the server's 401 message is shown instead of a model name.
        expect(p.page.get_by_role("alert")).to_contain_text("API key")
        expect(p.page.locator("#model-name")).to_have_text("unavailable")
        p.settings(api_key=KEY, temperature="0", max_tokens="16")
        p.page.get_by_label("API key").press("Tab")  # "change": stored, models reloaded
        expect(p.page.locator("#model-name")).to_have_text(
            model_id(keyed_url, Authorization=f"Bearer {KEY}"))
        expect(p.page.get_by_role("alert")).to_be_hidden()
        p.close_settings()
        reply = p.say("What is 2+2?")
        assert reply
        assert p.chat_auth[-1] == f"Bearer {KEY}"
        # Nothing sticks out sideways and the message box stays usable.
        assert p.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        for sel in (".msg-user", ".msg-assistant", "#prompt", "#send", "#stop", "#new-chat"):
            box = p.page.locator(sel).last.bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 360, sel
        p.page.get_by_role("button", name="New chat").click()
        expect(p.page.locator(".msg")).to_have_count(0)
        # The key is remembered across a reload; a new chat sends only its own messages.
        p.page.reload()
        expect(p.page.get_by_label("API key")).to_have_value(KEY)
        expect(p.page.locator("#model-name")).not_to_have_text("unavailable")
        p.settings(temperature="0", max_tokens="16")
        p.say("Sure thing")
        assert p.chat_bodies[-1]["messages"] == [{"role": "user", "content": "Sure thing"}]
        assert p.errors and all(HTTP_ERROR_LOG.search(e) for e in p.errors), p.errors
    finally:
        p.close()
