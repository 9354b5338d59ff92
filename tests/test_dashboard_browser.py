"""The dashboard in a real browser: ``place dashboard RUN --headless`` serves the app on a loopback port,
headless Debian chromium (driven by chromedriver through selenium) opens every page, waits until it has
rendered, checks its key text, its charts and that no exception or error box is shown, and saves a
screenshot to test-artifacts/ (git-ignored). Skips when chromium / chromedriver / selenium are absent
(``.ci/run`` installs chromium, so CI runs it)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from dashkit import make_run_dir

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

# page url -> (h1 title, text that must appear, minimum number of rendered charts). A deep link comes first:
# it is the first request the fresh server answers.
PAGES = {
    "plan": ("Plan", ["Memory per GPU", "Concurrent sequences vs context length", "verdict: FITS"], 2),
    "": ("moeplace", ["Simulations", "Comparisons", "Plan: per-GPU memory"], 0),
    "traces": ("Traces", ["Expert load per layer", "Skew per layer", "Inter-layer affinity", "Domain mix", "valid"], 5),
    "placement": ("Placement", ["Per-layer balancedness", "GPU loads of one layer", "Balance vs traffic",
                                "Launch and export", "sglang (SGLang)", "memory plan:"], 6),
    "simulate": ("Simulate", ["Simulated figures", "absolute figures are model estimates", "Latency CDFs",
                              "Throughput over time", "Pool occupancy over time", "Straggler time per MoE layer"], 6),
    "sweep": ("Sweep", ["Simulated figures", "GPU prices", "Workload chat", "Pareto frontier", "Frontier in cost",
                        "Cheapest per million output tokens", "Recommended deployment", "vllm serve",
                        "Points not simulated", "infeasible"], 1),
}

HAVE_BROWSER = os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)
IN_CI = os.environ.get("CI", "").lower() == "true"
# Locally a missing browser skips; in CI (.ci/run installs chromium) it is a failure, not a silent skip.
pytestmark = pytest.mark.skipif(not HAVE_BROWSER and not IN_CI,
                                reason="chromium / chromedriver not installed (apt-get install chromium chromium-driver)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = make_run_dir(tmp_path_factory.mktemp("browser") / "run")
    port = free_port()
    with open(tmp_path_factory.mktemp("log") / "streamlit.log", "w+") as log:
        # Its own session, so teardown can stop `place` and the streamlit process it started together.
        proc = subprocess.Popen([sys.executable, "-m", "moeplace.cli", "dashboard", str(run), "--port", str(port),
                                 "--address", "127.0.0.1", "--headless"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, url, log)
            yield url
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            log.seek(0)
            pytest.fail(f"the dashboard did not start (exit {proc.poll()}):\n{log.read()}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def browser():
    if not HAVE_BROWSER:
        pytest.fail(f"CI=true but {CHROMIUM} / {CHROMEDRIVER} are missing: .ci/run installs them")
    if IN_CI:
        from selenium import webdriver
    else:
        webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="moeplace-chromium-")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def count(driver, testid: str) -> int:
    from selenium.webdriver.common.by import By

    return len(driver.find_elements(By.CSS_SELECTOR, f'[data-testid="{testid}"]'))


def wait_rendered(driver, title: str, texts: list[str], min_charts: int, timeout: float = 90.0) -> str:
    """Poll until the page's title, texts and charts (drawn: a canvas or svg inside) are present and no
    script run is in progress; returns the page text."""
    from selenium.webdriver.common.by import By

    deadline = time.time() + timeout
    text, missing = "", texts
    while time.time() < deadline:
        time.sleep(0.5)
        h1 = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "h1")]
        if title not in h1 or count(driver, "stStatusWidget") or count(driver, "stException"):
            if count(driver, "stException"):
                break
            continue
        text = driver.find_element(By.TAG_NAME, "body").text
        missing = [t for t in texts if t not in text]
        drawn = len(driver.find_elements(By.CSS_SELECTOR, '[data-testid="stVegaLiteChart"] canvas, '
                                                          '[data-testid="stVegaLiteChart"] svg.marks'))
        if not missing and drawn >= min_charts:
            time.sleep(1.0)  # let the last charts paint before the screenshot
            return driver.find_element(By.TAG_NAME, "body").text
    raise AssertionError(f"page '{title}' did not render: missing {missing}, "
                         f"exceptions {count(driver, 'stException')}, charts {count(driver, 'stVegaLiteChart')}\n"
                         f"{text[:2000]}")


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    # Streamlit scrolls inside its own container: grow the window to the content to capture it all.
    height = driver.execute_script(
        "return Math.max(...Array.from(document.querySelectorAll('*')).map(e => e.scrollHeight));")
    driver.set_window_size(1400, int(min(max(height + 100, 900), 7000)))
    time.sleep(0.5)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1800)
    return path


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_in_chromium(server, browser, page):
    title, texts, min_charts = PAGES[page]
    browser.get(f"{server}/{page}")
    wait_rendered(browser, title, texts, min_charts)
    assert count(browser, "stException") == 0
    # app.py ran (its sidebar and navigation), not the page script alone: deep links work on a fresh server
    sidebar = browser.find_element("css selector", '[data-testid="stSidebar"]').text
    assert "Run directory" in sidebar and "Placement" in sidebar, sidebar
    errors = [e.text for e in browser.find_elements("css selector", '[data-testid="stAlertContentError"]')]
    assert not errors, errors
    shot = screenshot(browser, f"dashboard-{page or 'overview'}")
    assert shot.stat().st_size > 10_000  # a real rendering, not a blank page
    if page == "placement":
        shutil.copyfile(shot, ARTIFACTS / "dashboard.png")


def test_sidebar_navigation(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server)
    wait_rendered(browser, "moeplace", [], 0)
    browser.find_element(By.CSS_SELECTOR, '[data-testid="stSidebarNav"] a[href$="/plan"]').click()
    title, texts, charts = PAGES["plan"]
    wait_rendered(browser, title, texts, charts)
    assert browser.current_url.rstrip("/").endswith("/plan")
