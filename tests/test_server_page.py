"""GET /: the built-in page, loaded in a real headless browser (Debian's chromium through
selenium): it names the model, streams a chat reply into the page as it is generated, sends
the sampling fields it shows, and fills the engine view from /metrics."""
from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from conftest import track_engine
from kvserve.async_engine import AsyncLLMEngine
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.server.app import create_app
from kvserve.server.webpage import PAGE_DIR
from test_server import MODEL, TINY_ARGS, ServerThread, openai_client

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run")


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(**TINY_ARGS))
    track_engine(engine)
    async_engine = AsyncLLMEngine(engine)
    with ServerThread(create_app(async_engine, MODEL)) as thread:
        yield thread
    async_engine.shutdown()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium/chromedriver here and none could be installed: scripts/setup.sh "
                    "installs Debian's chromium and chromium-driver where apt-get exists and it runs as root")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in BROWSER_FLAGS:
        options.add_argument(flag)
    # The driver given by path: selenium's manager would otherwise try to download one.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_page_files_are_served_and_ship_with_the_package(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in ("/page/app.js", "/page/style.css"):
        assert httpx.get(server.url + asset).status_code == 200
    # Nothing is loaded from elsewhere (no CDN): every src/href is this server's.
    assert "http://" not in page.text and "https://" not in page.text
    assert {p.name for p in PAGE_DIR.iterdir()} >= {"index.html", "app.js", "style.css"}


def test_page_streams_a_chat_reply_and_shows_the_engine(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    wait_for(lambda: MODEL in browser.find_element(By.ID, "model").text, what="the model's name")
    # The engine view fills from /metrics.
    wait_for(lambda: "%" in browser.find_element(By.ID, "m-kv").text, what="the KV usage")
    assert browser.find_element(By.ID, "m-running").text == "0"
    # Record every body the page sends, and every change of the reply's text as it streams.
    browser.execute_script("""
        window.sentBodies = [];
        const fetch0 = window.fetch;
        window.fetch = (url, init) => {
            if (init && init.body) window.sentBodies.push([url, JSON.parse(init.body)]);
            return fetch0(url, init);
        };
        window.replyTexts = [];
        new MutationObserver(() => {
            const replies = document.querySelectorAll('.message.assistant');
            if (replies.length) window.replyTexts.push(replies[replies.length - 1].textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    """)
    for field, value in (("temperature", "0"), ("max_tokens", "48")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys("Tell me about caches")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: "finish" in browser.find_element(By.ID, "last-stats").text, what="the reply's end")
    reply = browser.execute_script(
        "const r = document.querySelectorAll('.message.assistant'); return r[r.length - 1].textContent")
    # Streamed: the reply grew in several steps, each a prefix of the next.
    texts = [t for t in browser.execute_script("return window.replyTexts") if t]
    assert len(set(texts)) > 2, texts
    assert all(reply.startswith(t) for t in texts)
    # The same reply the API gives for the request the page sent.
    ((url, body),) = browser.execute_script("return window.sentBodies")
    assert url == "/v1/chat/completions" and body["stream"] is True
    assert body["temperature"] == 0 and body["max_tokens"] == 48 and "response_format" not in body
    assert body["messages"] == [{"role": "user", "content": "Tell me about caches"}]
    expected = openai_client(server.url).chat.completions.create(
        model=MODEL, messages=body["messages"], temperature=0, max_tokens=48, top_p=body["top_p"])
    assert reply == expected.choices[0].message.content
    # The engine view counted the tokens.
    wait_for(lambda: browser.find_element(By.ID, "m-gen").text.split()[0] not in ("–", "0"),
             what="generated tokens in the engine view")
    # JSON output: the next turn asks for a JSON object, with the conversation so far.
    browser.find_element(By.ID, "json_mode").click()
    browser.find_element(By.ID, "prompt").send_keys("Now as JSON\n")  # Enter sends
    wait_for(lambda: len(browser.execute_script("return window.sentBodies")) == 2, what="the second request")
    _, second = browser.execute_script("return window.sentBodies")[1]
    assert second["response_format"] == {"type": "json_object"}
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == reply
    wait_for(lambda: not browser.find_element(By.ID, "stop").is_enabled(), what="the second reply's end")
    assert "error" not in browser.find_element(By.ID, "messages").text
    # Tools: the example tool goes out with the request (tool_choice auto).
    browser.find_element(By.ID, "json_mode").click()
    browser.find_element(By.ID, "tools_on").click()
    assert browser.find_element(By.ID, "tools").is_displayed()
    browser.find_element(By.ID, "prompt").send_keys("Weather in Paris?\n")
    wait_for(lambda: len(browser.execute_script("return window.sentBodies")) == 3, what="the third request")
    _, third = browser.execute_script("return window.sentBodies")[2]
    assert third["tools"][0]["function"]["name"] == "get_weather" and "response_format" not in third
    wait_for(lambda: not browser.find_element(By.ID, "stop").is_enabled(), what="the third reply's end")
    assert "error" not in browser.find_element(By.ID, "messages").text
    # Tools that are not JSON: said in the page, nothing sent.
    browser.find_element(By.ID, "tools").send_keys("{")
    browser.find_element(By.ID, "prompt").send_keys("Again\n")
    wait_for(lambda: "tools:" in browser.find_element(By.ID, "messages").text, what="the tools' error")
    assert len(browser.execute_script("return window.sentBodies")) == 3
    # A call the model makes is shown in the reply (the request made to call, by the test).
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}}}
    browser.execute_script("document.getElementById('tools').value = arguments[0]", json.dumps([tool]))
    browser.execute_script("""
        const fetch1 = window.fetch;
        window.fetch = (url, init) => {
            if (init && init.body) {
                const body = JSON.parse(init.body);
                body.tool_choice = {type: "function", function: {name: "pick"}};
                init = {...init, body: JSON.stringify(body)};
            }
            return fetch1(url, init);
        };
    """)
    browser.find_element(By.ID, "prompt").send_keys("Pick a colour\n")
    wait_for(lambda: "→ pick(" in browser.find_element(By.ID, "messages").text, what="the call in the reply")
    wait_for(lambda: not browser.find_element(By.ID, "stop").is_enabled(), what="the fourth reply's end")
    call_text = browser.find_elements(By.CSS_SELECTOR, ".message .call")[-1].text
    assert json.loads(call_text.removeprefix("→ pick(").removesuffix(")"))["colour"] in ("red", "blue")
