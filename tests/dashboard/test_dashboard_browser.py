"""/dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright) against
`kvflow serve` with the bundled model under a small load. The page loads without console errors, the
Gantt gains rows as requests arrive, the block map agrees with /metrics, a request aborted
mid-stream leaves the running set, and the doctor's view answers. It takes a screenshot under load:
into the test's temporary directory, or where KVFLOW_DASHBOARD_SCREENSHOT says (the README's picture:
`KVFLOW_DASHBOARD_SCREENSHOT=docs/dashboard.png`), so that a test run leaves the checkout as it was.

Skipped only when no Chromium binary is installed (.ci/run installs Debian's `chromium`).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from kvflow.assets import bundled_model_dir
from kvflow.bench.server_metrics import scrape
from kvflow.server.spawn import spawn_server, stop_server

CHROMIUM = os.environ.get("KVFLOW_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT_ENV = "KVFLOW_DASHBOARD_SCREENSHOT"
NUM_SHORT = 8  # the 8 concurrent requests
SHORT_TOKENS = 300
LONG_TOKENS = 900  # of the bundled model's 1024-token context; aborted long before it ends
WAIT_S = 30.0

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium binary: `apt-get install chromium` (or set KVFLOW_CHROMIUM)"
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`kvflow serve` (the bundled model) as a user starts it; its base URL. Its log goes to a file
    (a pipe nobody reads would stall a chatty server)."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with log_path.open("w") as log:
        # A small token budget per step, so that long prompts are prefilled in visible chunks.
        flags = ["--max-num-seqs", "8", "--max-num-batched-tokens", "128"]
        process, base = spawn_server(bundled_model_dir("target"), flags, stderr=log)
        try:
            yield base
        finally:
            stop_server(process)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # Debian's build, not Playwright's download (there is no network for that here).
        instance = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield instance
        instance.close()


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def model_name(base: str) -> str:
    return str(httpx.get(base + "/v1/models").json()["data"][0]["id"])


def stream_completion(base: str, prompt: str, max_tokens: int, stop: threading.Event | None = None) -> int:
    """Stream one completion; returns the content chunks read. With `stop`, the client hangs up as
    soon as it is set (an abort mid-stream, as a closed browser tab does)."""
    body = {"model": model_name(base), "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    chunks = 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if stop is not None and stop.is_set():
                break
    return chunks


def page_state(page: Page) -> dict[str, Any]:
    return dict(
        page.evaluate(
            """() => {
              const S = window.kvflowDashboard, F = S.F ? S.F.step : null;
              const last = F && S.steps.length ? S.steps[S.steps.length - 1] : null;
              return {
                frames: S.frames,
                requests: Number(document.getElementById('gantt').dataset.requests),
                rows: Number(document.getElementById('gantt').dataset.rows),
                running: [...document.querySelectorAll('#running-list li')].map((li) => li.dataset.id),
                used: Number(document.getElementById('kv-used').textContent),
                mapUsed: S.kv ? S.kv.used : 0,
                stepUsed: last && S.config ? Math.round(last[F.kv_usage] * S.config.num_blocks) : 0,
                numBlocks: S.config ? S.config.num_blocks : 0,
              };
            }"""
        )
    )


CHART_PANELS = ("usage-chart", "throughput-chart", "ttft-chart", "itl-chart")


def empty_panels(page: Page) -> list[str]:
    """The chart panels not drawn yet, or whose data series are all empty or all zero."""
    return list(
        page.evaluate(
            """(ids) => ids.filter((id) => {
                const u = window.kvflowDashboard.charts[id];
                return !u || !u.data.slice(1).some((ys) => ys.some((y) => y));
              })""",
            list(CHART_PANELS),
        )
    )


def page_shows_step_with(page: Page, num_used: int) -> bool:
    """Whether one of the steps the page holds left `num_used` blocks in use."""
    return bool(
        page.evaluate(
            """(n) => {
              const S = window.kvflowDashboard, i = S.F.step.kv_usage;
              return S.steps.some((row) => Math.round(row[i] * S.config.num_blocks) === n);
            }""",
            num_used,
        )
    )


def running_alone(page: Page) -> list[str] | None:
    running = page_state(page)["running"]
    return running if len(running) == 1 else None


def metrics_used_blocks(base: str) -> int:
    """Blocks in use by /metrics: kv_cache_usage_perc x num_kv_blocks (cache_config_info's label)."""
    snapshot = scrape(base + "/metrics")
    assert snapshot is not None
    (labels,) = snapshot["kvflow:cache_config_info"]
    usage = sum(snapshot["kvflow:kv_cache_usage_perc"].values())
    return round(usage * int(dict(labels)["num_kv_blocks"]))


def test_dashboard_in_a_browser(live: str, browser: Browser, tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    problems: list[str] = []
    page.on(
        "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(live + "/dashboard")
    wait_for("the hello frame", lambda: page_state(page)["frames"] >= 1)
    before = page_state(page)
    assert before["numBlocks"] > 0

    # Requests arrive one by one: the Gantt gains a row for each.
    # One system prompt for all (its blocks are shared), then each request's own text.
    system = "You are a helpful assistant who answers in Python. " * 6
    prompts = [system + f"request {i}: " + "tell me more " * (4 + 30 * (i % 3)) for i in range(NUM_SHORT)]
    threads = [threading.Thread(target=stream_completion, args=(live, p, SHORT_TOKENS)) for p in prompts]
    seen_consistent = 0
    max_used = 0
    for i, thread in enumerate(threads):
        thread.start()
        wait_for(f"Gantt row {i + 1}", lambda i=i: page_state(page)["requests"] >= before["requests"] + i + 1)
        state = page_state(page)
        max_used = max(max_used, state["used"])
        # The map shown and the step it was taken after agree on the blocks in use.
        seen_consistent += state["mapUsed"] == state["stepUsed"] == state["used"]
    # /metrics under load: the blocks in use it reports are those of a step the page has drawn.
    in_use = metrics_used_blocks(live)
    wait_for(f"a step with {in_use} blocks in use on the page", lambda: page_shows_step_with(page, in_use))
    time.sleep(0.5)  # the screenshot: the eight at work
    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "dashboard.png")
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(screenshot))
    assert screenshot.stat().st_size > 0
    for thread in threads:
        thread.join(120)
    assert max_used > 0 and seen_consistent > 0
    # Every panel holds data after the load, not only renders: the histograms count the finished
    # requests' TTFTs and their gaps, the series have points.
    wait_for("every panel to hold data", lambda: not empty_panels(page), timeout=10)
    # A page opened after the load gets the window in its hello frame: the same panels.
    late = browser.new_page(viewport={"width": 1280, "height": 800})
    late.goto(live + "/dashboard")
    wait_for("the late page's panels to hold data", lambda: not empty_panels(late), timeout=10)
    late.close()

    # A long request, aborted mid-stream by its client, leaves the running set.
    wait_for("the short requests to leave the running set", lambda: not page_state(page)["running"])
    stop = threading.Event()
    aborted = threading.Thread(target=stream_completion, args=(live, "a long story", LONG_TOKENS, stop))
    aborted.start()
    (rid,) = wait_for(
        "the long request running alone",
        lambda: page_state(page)["running"] if len(page_state(page)["running"]) == 1 else None,
    )
    stop.set()
    aborted.join(60)
    wait_for("the aborted request to leave the running set", lambda: rid not in page_state(page)["running"])
    reason = page.evaluate("(id) => window.kvflowDashboard.requests.get(id).reason", rid)
    assert reason == "abort"

    # Idle: the block map's used count is /metrics' (the map is sent as the engine goes idle).
    wait_for(
        "the block map to match /metrics",
        lambda: page_state(page)["used"] == metrics_used_blocks(live) == page_state(page)["mapUsed"],
    )
    doctor = httpx.get(live + "/dashboard/doctor", timeout=120)
    assert doctor.status_code == 200 and "kvflow</span> doctor" in doctor.text
    assert not problems, problems
    page.close()


def test_block_map_colours_by_cache_group(live: str, browser: Browser) -> None:
    """A model mixing cache kinds: used blocks take their group's colour (a hue per kind) and the
    legend names the kinds. The server's bundled model has one group, so the page is handed the
    block map of a two-group one (the schema of kvflow/server/dashboard/schema.py block_map_object)."""
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(live + "/dashboard")
    wait_for("the hello frame", lambda: page_state(page)["frames"] >= 1)
    page.evaluate(
        """() => {
          const S = window.kvflowDashboard, n = S.config.num_blocks;
          const owner = Array(n).fill(-1), group = Array(n).fill(-1);
          owner[0] = owner[1] = 0; group[0] = 0; group[1] = 1;  // one request, a block in each group
          S.kv = {owner, groups: [["r"]], cached_in_use: [], used: 2, cached_free: 0, shared: 0,
                  cache_group: group, cache_group_kinds: ["sliding_attention", "full_attention"]};
        }"""
    )
    wait_for("the legend of the cache groups", lambda: "sliding window" in page.inner_text("#kv-used-legend"))
    assert "full attention" in page.inner_text("#kv-used-legend")
    # The two used blocks' pixels (cells of the block map's layout) differ: two groups, two hues.
    colours = page.evaluate(
        """() => {
          const canvas = document.getElementById('blockmap'), n = window.kvflowDashboard.config.num_blocks;
          const cell = Math.max(3, Math.min(14, Math.floor(Math.sqrt((canvas.clientWidth * 260) / n))));
          const dpr = window.devicePixelRatio || 1, ctx = canvas.getContext('2d');
          const at = (i) => [...ctx.getImageData(Math.floor((i * cell + 1) * dpr), dpr, 1, 1).data];
          return [at(0), at(1), at(2)];
        }"""
    )
    assert colours[0] != colours[1] and colours[2] not in colours[:2]  # block 2 is free
    assert not problems, problems
    page.close()
