"""The chat page at / in a real headless browser (Debian's chromium driven by playwright) against
the real server over the fake engine: the page loads, shows the model, streams a reply, stops one.
"""

from __future__ import annotations

import shutil

import httpx
import pytest

from sparseinfer.server.app import ServerThread, create_app

from .fake_engine import FakeEngine
from .helpers import wait_until

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"]


def test_index_serves_the_chat_page(fake_server):
    r = httpx.get(fake_server[0].url + "/", timeout=10.0)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "<title>sparseinfer chat</title>" in r.text


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed "
                                   "(pip install -e '.[test]')")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (Debian/Ubuntu: apt-get install chromium)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield b
        b.close()


@pytest.fixture
def chat(browser):
    """(page at the server's /, fake engine) with 50 ms per token, so streaming is visible."""
    engine = FakeEngine(n_ctx=4096, token_delay=0.05)
    with ServerThread(create_app(engine)) as srv:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(srv.url + "/")
        yield page, engine
        page.close()


@pytest.mark.slow
def test_page_streams_a_reply_with_system_prompt_and_settings(chat, tmp_path):
    page, engine = chat
    page.wait_for_selector("#model:has-text('fake-model')")
    page.fill("#system", "You are terse.")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "64")
    words = "Emma Woodhouse handsome clever and rich with a comfortable home"
    page.fill("#input", f"Tell me. [[say:{words}]]")
    page.press("#input", "Enter")
    reply = page.locator(".msg.assistant").last
    # streaming: part of the reply is on the page while the Stop button is still up
    page.wait_for_function(
        "() => { const m = document.querySelector('.msg.assistant');"
        " return m && m.textContent.length > 0 && m.textContent.length < 40"
        " && document.getElementById('send').textContent === 'Stop'; }")
    page.wait_for_selector(".stats:has-text('finish: stop')")
    assert reply.text_content() == words
    assert page.locator("#send").text_content() == "Send"
    assert engine.started[-1].startswith("<|system|>You are terse.\n<|user|>Tell me.")
    assert engine.params[-1].temperature == 0 and engine.params[-1].max_tokens == 64

    shot = tmp_path / "chat.png"
    page.screenshot(path=str(shot))
    from PIL import Image

    img = Image.open(shot).convert("L")
    assert img.size == (1100, 700)
    box = reply.bounding_box()
    assert box and box["y"] + box["height"] <= 700  # the reply is in view
    crop = img.crop((int(box["x"]), int(box["y"]), int(box["x"] + box["width"]),
                     int(box["y"] + box["height"])))
    lo, hi = crop.getextrema()
    assert hi - lo > 100  # dark text on a light bubble, not a blank area
    assert len(img.getcolors(1 << 16)) > 20  # the page rendered, not one colour


@pytest.mark.slow
def test_stop_button_cancels_the_stream(chat):
    page, engine = chat
    page.wait_for_selector("#model:has-text('fake-model')")
    page.fill("#max_tokens", "200")  # the fake engine counts to ten, over and over
    page.fill("#input", "Count for me")
    page.click("#send")
    page.wait_for_function("() => (document.querySelector('.msg.assistant') || {})"
                           ".textContent?.split(' ').length >= 3")
    page.click("#send")  # now the Stop button
    page.wait_for_selector(".stats:has-text('stopped')")
    assert page.locator("#send").text_content() == "Send"
    assert wait_until(lambda: engine.cancelled == 1, timeout=5.0)
    assert len(page.locator(".msg.assistant").last.text_content().split()) < 200


@pytest.mark.slow
def test_page_shows_a_thinking_models_thoughts_apart(browser):
    """A thinking model's reasoning_content streams into a folding block above the answer; the
    conversation sent back holds only the answer."""
    engine = FakeEngine(n_ctx=4096, token_delay=0.01, think=True)
    with ServerThread(create_app(engine)) as srv:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(srv.url + "/")
        page.wait_for_selector("#model:has-text('fake-model')")
        page.fill("#input", "[[spell:<think>\nAdd them.\n</think>\n\nIt is 4.]]")
        page.press("#input", "Enter")
        page.wait_for_selector(".stats:has-text('finish: stop')")
        thoughts = page.locator("details.thinking")
        assert thoughts.count() == 1
        assert thoughts.locator("summary").text_content() == "Thinking"
        assert thoughts.locator("div").text_content() == "Add them."
        assert thoughts.get_attribute("open") is None  # folded once the answer came
        assert page.locator(".msg.assistant").last.text_content() == "It is 4."
        page.fill("#input", "[[spell:ok]]")
        page.press("#input", "Enter")
        page.wait_for_function("() => document.querySelectorAll('.stats').length == 2")
        assert "<|assistant|>It is 4.\n" in engine.started[-1]
        assert engine.started[-1].count("Add them") == 1  # in the user's turn only
        page.close()
