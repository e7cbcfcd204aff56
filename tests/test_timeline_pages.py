"""The timeline and console pages against a running `conveyor serve` (SmolLM2, SQLite, a tiny KV
cache of 12 blocks and 2 running sequences with forced swap, so that a priority-0 request
preempts a running priority-5 one), over HTTP and in a real browser: Debian's Chromium driven
by Playwright (never a browser Playwright downloads).

Without Chromium these tests skip, except in CI (`CI=true`), where they fail: `make test`
installs the browser. The screenshots in docs/images/ are written by these tests."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from test_admin_api import LONG_PROMPT, TINY_KV_ARGS, admin, audit_detail, call, complete
from test_server_support import (
    ADMIN_TOKEN,
    MODEL_NAME,
    ServerProcess,
    server_env,
    serving,
    tiny_engine_args,
)

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser")
VIEWPORT = {"width": 1280, "height": 900}


# ---- the server and its tenants ----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("timeline")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    env = server_env(database_url, None, workdir) | {"CONVEYOR_CREATE_DEMO_TENANT": "false"}
    process = ServerProcess(workdir, env, TINY_KV_ARGS, database_url).start()
    with serving(process):
        yield process


def new_tenant(server, **fields) -> tuple[dict, str]:
    created = admin(server, "POST", "/tenants", {"name": f"t-{uuid.uuid4().hex[:8]}", **fields})
    assert created.status == 201, created.raw
    key = admin(server, "POST", f"/tenants/{created.body['id']}/keys")
    assert key.status == 201, key.raw
    return created.body, key.body["key"]


def open_stream(server, key: str, prompt: str, max_tokens: int, model: str = MODEL_NAME):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        json.dumps(body).encode(),
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    return urllib.request.urlopen(request, timeout=120)


@pytest.fixture(scope="module")
def preempted(server):
    """A priority-5 request preempted (swapped out) by a priority-0 one of another tenant."""
    low, low_key = new_tenant(server, default_priority=5, max_priority=5)
    high, high_key = new_tenant(server, default_priority=0)
    with open_stream(server, low_key, LONG_PROMPT, 30) as stream:
        low_id = stream.headers["x-request-id"]
        assert stream.readline().startswith(b"data: ")  # its first token: it holds 10 blocks
        urgent = complete(server, high_key, prompt="Hello there, how are you? " * 6, max_tokens=5)
        assert urgent.status == 200
        stream.read()
    detail = audit_detail(server, low_id, token=low_key)
    assert detail.status == 200
    assert detail.body["record"]["num_preemptions_swap"] >= 1, detail.body["explanation"]
    return {
        "low_id": low_id, "low_key": low_key, "low": low, "high": high, "high_key": high_key,
        "urgent_id": urgent.request_id, "detail": detail.body,
    }  # fmt: skip


# ---- over HTTP ---------------------------------------------------------------------------------
def test_the_explanation_links_to_its_timeline(server, preempted):
    low_id = preempted["low_id"]
    assert preempted["detail"]["timeline_url"] == f"/v1/requests/{low_id}/timeline"
    operator = audit_detail(server, low_id)
    assert operator.body["timeline_url"] == f"/admin/requests/{low_id}/timeline"
    page = call(server, "GET", preempted["detail"]["timeline_url"], preempted["low_key"])
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    policy = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "unsafe" not in policy
    assert call(server, "GET", f"/admin/requests/{low_id}/timeline", ADMIN_TOKEN).status == 200
    # the tenant's key is no admin token, and no key is no page
    assert (
        call(server, "GET", f"/admin/requests/{low_id}/timeline", preempted["low_key"]).status
        == 403
    )
    assert call(server, "GET", f"/v1/requests/{low_id}/timeline").status == 401


def test_the_search_box_takes_an_x_request_id_or_a_body_id(server, preempted):
    low_id, key = preempted["low_id"], preempted["low_key"]
    opener = urllib.request.build_opener(NoRedirect)
    for given in (low_id, f"  cmpl-{low_id} "):
        query = urllib.parse.urlencode({"find": given})
        request = urllib.request.Request(
            f"{server.base_url}/v1/requests/{low_id}/timeline?{query}",
            headers={"Authorization": f"Bearer {key}"},
        )
        with pytest.raises(urllib.error.HTTPError) as redirect:
            opener.open(request, timeout=10)
        assert redirect.value.code == 303
        assert redirect.value.headers["Location"] == f"/v1/requests/{low_id}/timeline"
        redirect.value.close()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def basic(secret: str) -> str:
    return "Basic " + base64.b64encode(f"me:{secret}".encode()).decode()


def test_a_browser_without_headers_is_asked_for_the_key_and_only_reads_with_it(server, preempted):
    low_id, key = preempted["low_id"], preempted["low_key"]
    for path in (f"/v1/requests/{low_id}/timeline", "/admin/console"):
        asked = call(server, "GET", path)
        assert asked.status == 401
        assert asked.headers["WWW-Authenticate"] == 'Basic realm="Conveyor", charset="UTF-8"'
    assert "WWW-Authenticate" not in call(server, "GET", f"/v1/requests/{low_id}").headers
    page = urllib.request.Request(
        f"{server.base_url}/v1/requests/{low_id}/timeline", headers={"Authorization": basic(key)}
    )
    with urllib.request.urlopen(page, timeout=10) as response:
        assert response.status == 200
    # Basic, which a browser sends unasked, never spends tokens, touches a rate limit or changes
    # anything: only the pages and the console's reads take it
    models = urllib.request.Request(
        f"{server.base_url}/v1/models", headers={"Authorization": basic(key)}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(models, timeout=10)
    assert refused.value.code == 401
    refused.value.close()
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}).encode()
    post = urllib.request.Request(
        f"{server.base_url}/v1/completions",
        body,
        {"Authorization": basic(key), "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(post, timeout=10)
    assert refused.value.code == 401
    refused.value.close()
    created = urllib.request.Request(
        f"{server.base_url}/admin/tenants",
        json.dumps({"name": f"t-{uuid.uuid4().hex[:8]}"}).encode(),
        {"Authorization": basic(ADMIN_TOKEN), "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(created, timeout=10)
    assert refused.value.code == 401
    refused.value.close()


def test_the_static_files_are_served_from_the_package(server):
    script = call(server, "GET", "/pages/static/conveyor.js")
    assert script.status == 200 and script.headers["Content-Type"].startswith("text/javascript")
    assert b"innerHTML" not in script.raw  # the script writes text, never HTML
    assert call(server, "GET", "/pages/static/conveyor.css").status == 200
    assert call(server, "GET", "/pages/static/..%2Fpages%2Frender.py").status == 404


# ---- in the browser ----------------------------------------------------------------------------
def chromium_path() -> str | None:
    return os.environ.get("CONVEYOR_CHROMIUM") or next(
        filter(None, map(shutil.which, CHROMIUM_CANDIDATES)), None
    )


def browser_required() -> bool:
    """In CI (`CI=true`) and under `make test` a missing browser is a failure, not a skip."""
    flags = (os.environ.get("CI", ""), os.environ.get("CONVEYOR_REQUIRE_BROWSER", ""))
    return any(flag.lower() in ("1", "true", "yes") for flag in flags)


def missing(message: str):
    if browser_required():
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        missing("no Chromium here: `apt-get install -y chromium` (`make browser` does it)")
    try:
        from playwright import sync_api
    except ImportError:
        missing("no playwright: `pip install -e '.[test]'`")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox cannot start
        browser = playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield browser
        browser.close()


class Page:
    """A browser page whose requests carry `token`, and every console error and page error.
    `basic`: as a person's browser would, answering the page's Basic challenge with the token."""

    def __init__(self, browser, token: str, basic: bool = False) -> None:
        if basic:
            credentials = {"username": "me", "password": token}
            self.context = browser.new_context(http_credentials=credentials, viewport=VIEWPORT)
        else:
            headers = {"Authorization": f"Bearer {token}"}
            self.context = browser.new_context(extra_http_headers=headers, viewport=VIEWPORT)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("dialog", self._dialog)

    def _console(self, message) -> None:
        if message.type in ("error", "warning"):
            self.errors.append(f"{message.type}: {message.text}")

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def pages(browser):
    opened: list[Page] = []

    def open_page(token: str, basic: bool = False) -> Page:
        opened.append(Page(browser, token, basic))
        return opened[-1]

    yield open_page
    for page in opened:
        page.close()


def segments_of(page) -> list[dict]:
    """The request's own segments as drawn, read from their data attributes."""
    names = ("kind", "start-s", "end-s", "duration-s", "sentence", "cause", "cause-visible")
    return page.locator("#timeline g.subject .seg").evaluate_all(
        "(nodes, names) => nodes.map(node =>"
        " Object.fromEntries(names.map(name => [name, node.getAttribute(`data-${name}`)])))",
        list(names),
    )


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_preempted_request_is_drawn_in_order_with_its_cause(server, preempted, pages):
    detail, low_id = preempted["detail"], preempted["low_id"]
    view = pages(preempted["low_key"])
    view.page.goto(f"{server.base_url}/v1/requests/{low_id}/timeline")
    drawn = segments_of(view.page)
    kinds = [s["kind"] for s in drawn]
    assert kinds[0] == "gateway" and "preempted" in kinds and kinds[-1] == "decode"
    assert kinds.index("prefill") < kinds.index("decode") < kinds.index("preempted"), kinds
    assert kinds[kinds.index("preempted") + 1] == "decode"  # swapped back in, decoding again
    # one after the other, no gap, from arrival to the end the explanation measured
    starts, ends = [float(s["start-s"]) for s in drawn], [float(s["end-s"]) for s in drawn]
    assert starts[0] == 0.0 and starts[1:] == pytest.approx(ends[:-1], abs=2e-6)
    assert ends[-1] == pytest.approx(detail["total_time_s"], abs=2e-6)
    # the delays drawn are the explanation's, with its durations and sentences
    delays = [s for s in drawn if s["kind"] not in ("prefill", "decode")]
    assert [d["kind"] for d in delays] == [d["cause"] for d in detail["delays"]]
    for segment, delay in zip(delays, detail["delays"]):
        assert float(segment["duration-s"]) == pytest.approx(delay["duration_s"], abs=2e-6)
        assert segment["sentence"] == delay["sentence"]
    preemption = drawn[kinds.index("preempted")]
    record = detail["record"]
    assert float(preemption["duration-s"]) == pytest.approx(record["preempted_time_s"], rel=0.05)
    # its cause: another tenant's request, by priority only
    assert preemption["cause"] == "a request of another tenant (priority 0)"
    assert preemption["cause-visible"] == "false"
    html = view.page.content()
    assert preempted["urgent_id"] not in html and preempted["high"]["name"] not in html
    # the first token ends the prefill; tokens/s over the decode
    first_token = float(view.page.locator('[data-mark="first_token"]').get_attribute("data-at-s"))
    assert first_token == pytest.approx(ends[kinds.index("prefill")], abs=2e-6)
    rate = float(view.page.locator(".lane-rate").first.get_attribute("data-tokens-per-s"))
    decode_s = sum(float(s["duration-s"]) for s in drawn if s["kind"] == "decode")
    assert rate == pytest.approx((record["completion_tokens"] - 1) / decode_s, rel=1e-3)
    # hovering shows its exact times and the explanation's sentence
    view.page.locator("#timeline g.subject .seg-preempted").hover()
    tip = view.page.locator("#tip")
    assert tip.is_visible()
    assert preemption["sentence"] in tip.text_content()
    shown = re.search(r"\(([0-9.]+) ms\)", tip.text_content())  # rounded to 0.1 ms by the page
    assert shown and float(shown[1]) == pytest.approx(
        float(preemption["duration-s"]) * 1e3, abs=0.11
    )
    IMAGES.mkdir(parents=True, exist_ok=True)
    view.page.screenshot(path=str(IMAGES / "timeline.png"), full_page=True)
    assert view.errors == []


def test_an_operator_sees_the_cause_and_the_request_that_pushed_it_aside(server, preempted, pages):
    view = pages(ADMIN_TOKEN)
    view.page.goto(f"{server.base_url}/admin/requests/{preempted['low_id']}/timeline")
    cause = view.page.locator("#timeline g.subject .seg-preempted").get_attribute("data-cause")
    assert cause == (
        f"request {preempted['urgent_id']} (priority 0, tenant {preempted['high']['name']})"
    )
    neighbour = view.page.locator("#timeline g.neighbour")
    assert neighbour.get_attribute("data-request-id") == preempted["urgent_id"]
    assert neighbour.locator(".seg-decode").count() >= 1
    view.page.locator("#timeline g.subject .seg-preempted").hover()
    assert "swapped out to CPU" in view.page.locator("#tip").text_content()
    IMAGES.mkdir(parents=True, exist_ok=True)
    view.page.screenshot(path=str(IMAGES / "timeline-operator.png"), full_page=True)
    view.page.locator("a.cause-link").click()
    view.page.wait_for_url(f"**/admin/requests/{preempted['urgent_id']}/timeline")
    assert view.page.locator("#request-id").text_content() == preempted["urgent_id"]
    assert view.errors == []


def test_another_tenants_key_gets_404(server, preempted, pages):
    view = pages(preempted["high_key"])
    response = view.page.goto(f"{server.base_url}/v1/requests/{preempted['low_id']}/timeline")
    assert response.status == 404
    assert preempted["low"]["name"] not in view.page.content()
    assert view.page.locator("#missing-id").text_content() == preempted["low_id"]


def test_a_request_id_with_a_script_renders_inert(server, preempted, pages):
    view = pages(preempted["low_key"])
    hostile = "<script>alert(document.domain)"
    quoted = urllib.parse.quote(hostile, safe="")
    response = view.page.goto(f"{server.base_url}/v1/requests/{quoted}/timeline")
    assert response.status == 404
    assert view.page.locator("#missing-id").text_content() == hostile
    # and through the search box, closing tag and all
    typed = '"><script>alert(1)</script><img src=x onerror=alert(2)>'
    view.page.fill("#find", typed)
    view.page.click(".search button")
    view.page.wait_for_load_state()
    assert view.page.locator("#missing-id").text_content() == typed
    assert view.page.locator("script").count() == 1  # the page's own, from /pages/static
    assert view.page.locator("img").count() == 0
    assert view.dialogs == []


def tokens_per_s_shown(page) -> bool:
    """The tokens/s card above zero now or at a refresh since: the streams of a fast engine can
    end between two refreshes, and then the card reads 0 again; its sparkline keeps the rates
    (its maximum is at least 1 by construction)."""
    now = float(page.locator("#tokens-per-s").get_attribute("data-value") or 0)
    peak = (page.locator("#spark-tokens-max").text_content() or "max 0").removeprefix("max ")
    return now > 0 or float(peak) > 1


NUM_CONSOLE_STREAMS, CONSOLE_STREAM_TOKENS = 6, 176


def test_the_console_updates_while_requests_run(server, preempted, pages):
    view = pages(ADMIN_TOKEN)
    view.page.goto(f"{server.base_url}/admin/console")
    status = view.page.locator("#status")
    wait_until(lambda: int(status.get_attribute("data-refreshes")) >= 1, what="a first refresh")
    streams, ids = [], []
    # two run at a time (more streams wait in a queue that answers 503 past 6): three waves
    # outlast a refresh of a page in a loaded browser. One wave of 48 tokens could come and go
    # between two of them; three waves of 96 tokens, about 3 s, did too, once with a second
    # suite beside this one and once in CI. 176 tokens: the most the served model's context of
    # 192 leaves after the prompt, about 6 s.
    for _ in range(NUM_CONSOLE_STREAMS):
        stream = open_stream(
            server, preempted["low_key"], "Tell me a long story.", CONSOLE_STREAM_TOKENS
        )
        streams.append(stream)
        ids.append(stream.headers["x-request-id"])
    readers = [threading.Thread(target=stream.read) for stream in streams]
    for reader in readers:
        reader.start()
    try:
        # the table and the counters of one refresh: the counters read after it may be another's
        shown = wait_until(
            lambda: showing_any_of(console_snapshot(view.page), ids), what="a running request"
        )
        assert shown["running"] >= 1
        group = view.page.locator("#groups tr").first.text_content()
        assert "5" in group and preempted["low"]["name"] in group
        wait_until(lambda: tokens_per_s_shown(view.page), what="tokens/s above zero")
        view.page.screenshot(path=str(IMAGES / "console.png"), full_page=True)
    finally:
        for reader in readers:
            reader.join(timeout=120)
        for stream in streams:
            stream.close()
    # when they are done they leave the engine and appear among the recent requests
    wait_until(lambda: not set(ids) & set(rows(view.page, "#sequences")), what="the engine empty")
    wait_until(lambda: set(ids) <= set(rows(view.page, "#slowest")), what="the recent requests")
    link = view.page.locator(f'#slowest tr[data-request-id="{preempted["low_id"]}"] a')
    assert link.get_attribute("href") == f"/admin/requests/{preempted['low_id']}/timeline"
    # the last minutes, from the audit log: at least our requests' tokens and the preemption
    tokens = float(view.page.locator("#history-tokens").get_attribute("data-total")) * 10
    assert tokens >= NUM_CONSOLE_STREAMS * CONSOLE_STREAM_TOKENS + 30
    assert float(view.page.locator("#history-preemptions").get_attribute("data-total")) >= 1
    assert shown and view.errors == []


def test_a_person_opens_the_pages_in_a_plain_browser(server, preempted, pages):
    """No extension, no header: the browser answers the Basic challenge and the console's
    own reads of the admin endpoints carry the same credentials."""
    view = pages(preempted["low_key"], basic=True)
    response = view.page.goto(f"{server.base_url}/v1/requests/{preempted['low_id']}/timeline")
    assert response.status == 200
    assert view.page.locator("#timeline g.subject .seg-preempted").count() == 1
    console = pages(ADMIN_TOKEN, basic=True)
    assert console.page.goto(f"{server.base_url}/admin/console").status == 200
    status = console.page.locator("#status")
    wait_until(lambda: int(status.get_attribute("data-refreshes")) >= 2, what="two refreshes")
    assert console.errors == [] and view.errors == []


def rows(page, table: str) -> list[str]:
    # read in one evaluation: a live table re-renders between a locator's listing and its reads
    return page.locator(f"{table} tr").evaluate_all(
        "rows => rows.map(row => row.getAttribute('data-request-id'))"
    )


# ---- a hundred at once -------------------------------------------------------------------------
NUM_CONCURRENT = 100


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory, tiny_model_dir):
    """The tiny random Llama with room for a hundred running sequences."""
    workdir = tmp_path_factory.mktemp("timeline-busy")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    env = server_env(database_url, None, workdir) | {
        "CONVEYOR_CREATE_DEMO_TENANT": "false",
        "CONVEYOR_MAX_WAITING_REQUESTS": "64",
    }
    args = tiny_engine_args(tiny_model_dir)
    args[args.index("--max-num-seqs") + 1] = str(NUM_CONCURRENT + 16)
    process = ServerProcess(workdir, env, args, database_url).start()
    with serving(process):
        yield process


def console_snapshot(page) -> dict:
    """What one refresh of the console shows: its table's request ids and its counters, read in
    one evaluation (the page may refresh between two reads)."""
    return page.evaluate(
        """() => {
            const count = (line) => Number(document.getElementById(`num-${line}`).dataset.value);
            const rows = [...document.querySelectorAll("#sequences tr")];
            return {rows: rows.map((row) => row.dataset.requestId), waiting: count("waiting"),
                    running: count("running"), swapped: count("swapped")};
        }"""
    )


def showing_any_of(snapshot: dict, request_ids: list[str]) -> dict | None:
    return snapshot if set(request_ids) & set(snapshot["rows"]) else None


def with_a_full_table(snapshot: dict) -> dict | None:
    return snapshot if len(snapshot["rows"]) == NUM_CONCURRENT else None


def test_the_console_keeps_up_with_a_hundred_concurrent_requests(
    busy_server, tiny_model_dir, pages
):
    _, key = new_tenant(busy_server)
    view = pages(ADMIN_TOKEN)
    view.page.goto(f"{busy_server.base_url}/admin/console")
    status = view.page.locator("#status")
    wait_until(lambda: int(status.get_attribute("data-refreshes")) >= 1, what="a first refresh")
    streams = [
        open_stream(busy_server, key, f"Request number {i}.", 200, tiny_model_dir.name)
        for i in range(NUM_CONCURRENT)
    ]  # fmt: skip
    readers = [threading.Thread(target=stream.read) for stream in streams]
    for reader in readers:
        reader.start()
    try:
        # the table and the counters come from one refresh: read them together, as the requests
        # may all finish within the next two refreshes
        shown = wait_until(
            lambda: with_a_full_table(console_snapshot(view.page)),
            what="a hundred sequences on the console",
        )
        before = int(status.get_attribute("data-refreshes"))
        wait_until(
            lambda: int(status.get_attribute("data-refreshes")) >= before + 2,
            what="two more refreshes under load",
        )
        assert shown["waiting"] + shown["running"] + shown["swapped"] >= NUM_CONCURRENT
    finally:
        for reader in readers:
            reader.join(timeout=120)
        for stream in streams:
            stream.close()
    assert all(not reader.is_alive() for reader in readers)
    assert view.errors == []
