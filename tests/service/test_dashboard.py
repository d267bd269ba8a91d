"""The dashboard in a real browser: Debian's headless Chromium, driven by Selenium through chromium-driver, against the
app served by uvicorn on loopback, with a temporary SQLite store seeded by a small real verify and profile run.

Each view is loaded and its rendered content compared with what the JSON API answers; the browser console must hold no
errors beyond the HTTP errors a step provokes on purpose; a verify job and a profile job run to completion from the
page and a queued job is cancelled from it. Screenshots at 1280x800 and 400 px wide go to test-output/dashboard/.

`make test` installs chromium and chromium-driver when run as root (and then sets DASHBOARD_TEST_REQUIRE_BROWSER=1, so
a missing browser fails instead of skipping); elsewhere this module skips and says how to install them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from http import HTTPStatus
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import torch
from fastapi.testclient import TestClient

from registry.core import kernels
from service.dashboard import ASSETS, SECURITY_HEADERS
from service.main import create_app

# The cpp_op composites are valid where the C++ ops are built (make test builds them; without a compiler they are not).
CPP_OP_VERDICT = {"cpp_op": "valid" if kernels.fused_ops_available() else "invalid"}

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.remote.webelement import WebElement
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # a dev dependency; the browser fixture says how to get it
    pass

CHROMIUM = Path(os.environ.get("TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("TEST_CHROMEDRIVER", "/usr/bin/chromedriver"))
REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "test-output" / "dashboard"
TOKEN = "dashboard-test-token"
WIDE = (1280, 800)
NARROW = (400, 800)
SEVERITY = ("ok", "unsupported", "slow", "mismatch", "error")  # worst last, as the page and the PNG heatmap rank


def _missing_browser() -> str | None:
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        return (f"the dashboard's browser test needs Debian's chromium and chromium-driver ({', '.join(missing)} "
                "missing): run `make test` as root, or `sudo apt-get install chromium chromium-driver`")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the dashboard's browser test needs selenium: `make venv` installs the dev extra"
    return None


# ---------------------------------------------------------------- the routes, without a browser


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app())


def test_page_and_assets_are_served_from_the_package(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == SECURITY_HEADERS["Content-Security-Policy"]
    assert page.headers["cache-control"] == "no-cache"
    # Everything the page loads is one of the package's own assets: nothing from a CDN.
    loaded = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
    assert sorted(loaded) == ["/dashboard/dashboard.css", "/dashboard/dashboard.js", "/dashboard/favicon.svg"]
    for path in loaded:
        asset = client.get(path)
        name = path.rsplit("/", 1)[1]
        assert (asset.status_code, asset.headers["content-type"]) == (200, ASSETS[name])
        assert asset.content == (files("service.dashboard") / "static" / name).read_bytes()
        assert client.get(path, headers={"If-None-Match": asset.headers["etag"]}).status_code == 304
    assert "http" not in client.get("/dashboard/dashboard.js").text.replace("http://www.w3.org/2000/svg", "")


def test_unknown_assets_are_404_without_reading_files(client: TestClient) -> None:
    # A path with a slash in it (encoded or not) matches no route at all.
    assert client.get("/dashboard/..%2F__init__.py").json() == {"detail": "Not Found"}
    for name in ("nope.js", "index.html", "__init__.py", "static", "dashboard.js%00"):
        response = client.get(f"/dashboard/{name}")
        assert response.status_code == 404, name
        assert response.json() == {"detail": f"no dashboard asset {unquote(name)!r}; assets: dashboard.css, "
                                             "dashboard.js, favicon.svg"}
    assert client.get("/dashboard/" + "x" * 500).json()["detail"].startswith(f"no dashboard asset {'x' * 60!r};")
    assert "/" not in {route.path for route in create_app().routes if getattr(route, "include_in_schema", False)}


# ---------------------------------------------------------------- the app with a seeded store


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh SQLite store holding real verify results (masked_fill under vmap and vmap(grad)) and timings."""
    from registry.harness.verify import verify
    from registry.profiling.timing import profile
    from registry.store.db import Store

    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard-store') / 'store.db'}"
    with Store(url) as store:
        store.write_entries(verify(ops=["masked_fill"], stacks=["vmap", "vmap,grad"], dtypes=(torch.float32,),
                                   workers=1))
        # Seed data for the page, not a measurement: the noise control's refusal is off (spread_limit), so a loaded
        # machine cannot leave the charts empty.
        store.write_profiles(profile(ops=["masked_fill"], workloads=["vmap"], batch_sizes=(4,), numels=(64,),
                                     min_run_time=0.01, spread_limit=float("inf")))
    return url


def _free_port() -> int:
    wanted = os.environ.get("DASHBOARD_TEST_PORT")  # a fixed port where the machine's ports are shared out
    if wanted:
        return int(wanted)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(store_url: str) -> Iterator[str]:
    """The real app under uvicorn on a free loopback port, with auth on; its base URL."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "MULTICOMPOSITE_DB": store_url, "MULTICOMPOSITE_TOKEN": TOKEN}
    log = (OUTPUT / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "service.main:create_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {process.returncode}; see {OUTPUT / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not answer /healthz within 60 s; see {OUTPUT / 'server.log'}")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def api(base: str, path: str, **params: str) -> Any:
    """What the JSON API answers, read without the browser; a paged answer is followed to its end."""
    items: list[Any] = []
    cursor = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        with urllib.request.urlopen(url, timeout=30) as response:
            body = json.load(response)
        if not (isinstance(body, dict) and "items" in body):
            return items + body if items else body
        items += body["items"]
        cursor = body.get("next_cursor")
        if not cursor:
            return items


# ---------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    why_not = _missing_browser()
    if why_not is not None:
        if os.environ.get("DASHBOARD_TEST_REQUIRE_BROWSER") == "1":  # make test as root: it could install them
            pytest.fail(why_not, pytrace=False)
        pytest.skip(why_not)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile_dir = tmp_path_factory.mktemp("chromium-profile")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={WIDE[0]},{WIDE[1]}", "--force-device-scale-factor=1", "--no-first-run",
                     "--disable-extensions", "--disable-background-networking", "--disable-sync",
                     f"--user-data-dir={profile_dir}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: Selenium Manager (which would try to download a driver) never runs.
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(OUTPUT / "chromedriver.log"))
    OUTPUT.mkdir(parents=True, exist_ok=True)
    driver = webdriver.Chrome(options=options, service=service)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile_dir, ignore_errors=True)


def viewport(driver: WebDriver, size: tuple[int, int]) -> None:
    """An exact CSS viewport (a window's size would include whatever the browser keeps around the page)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": False})
    assert driver.execute_script("return [window.innerWidth, window.innerHeight]") == list(size)


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str, timeout: float = 20) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition, message=f"waited {timeout} s for {what}")


def open_view(driver: WebDriver, base: str, view: str) -> None:
    """Load the page afresh on ``view`` and wait until it has asked the API for everything once."""
    driver.get("about:blank")  # else a URL that differs only in its #view would keep the page and its state
    driver.get(f"{base}/#{view}")
    wait_for(driver, lambda d: d.execute_script("return document.body.dataset.ready") == "true", "the page to load")


def go(driver: WebDriver, view: str) -> None:
    """Switch views the way a keyboard user does: focus the nav link and press Enter."""
    driver.find_element(By.ID, f"nav-{view}").send_keys(Keys.ENTER)
    wait_for(driver, lambda d: d.find_element(By.ID, f"view-{view}").is_displayed(), f"the {view} view")


def shoot(driver: WebDriver, name: str) -> Path:
    path = OUTPUT / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"could not write {path}"
    return path


def console_errors(driver: WebDriver) -> list[str]:
    """The console's errors since the last call (reading the log empties it), the page's URL prefix removed."""
    return [re.sub(r"^http://127\.0\.0\.1:\d+", "", entry["message"]) for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE"]


def failed_request(path: str, status: int) -> str:
    """How Chromium logs a fetch that got an HTTP error (a network-level message, not one of the page's); the reason
    phrase is the one the server's Python sends."""
    return (f"{path} - Failed to load resource: the server responded with a status of {status} "
            f"({HTTPStatus(status).phrase})")


def text(driver: WebDriver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


# ---------------------------------------------------------------- the views


def _worst(statuses: list[str]) -> str:
    return max(statuses, key=SEVERITY.index)


def _label(stack: list[str] | str) -> str:
    parts = stack if isinstance(stack, list) else [p for p in re.split(r"[,()]", stack) if p]
    return "(".join(parts) + ")" * (len(parts) - 1) if parts else "eager"


def measured_text(entry: dict[str, Any]) -> str:
    """What the page shows for when ``entry`` was measured: the first timestamp field the API gives, in UTC."""
    for name in ("measured_at", "updated_at", "created_at", "timestamp"):
        value = entry.get(name)
        if value is None or value == "":
            continue
        if isinstance(value, (int, float)):
            moment = datetime.fromtimestamp(value, tz=timezone.utc)
        else:
            moment = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00"))
            moment = moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    return "not recorded"


def expected_grid(entries: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(op/composite, stack label) -> the worst status over the entries of that cell."""
    statuses: dict[tuple[str, str], list[str]] = {}
    for entry in entries:
        statuses.setdefault((f"{entry['op']}/{entry['composite']}", _label(entry["stack"])), []).append(entry["status"])
    return {key: _worst(found) for key, found in statuses.items()}


def rendered_grid(driver: WebDriver) -> dict[tuple[str, str], str]:
    """(op/composite, stack label) -> the status a heatmap cell shows, for every measured cell on the page."""
    return {(cell["row"], cell["stack"]): cell["text"] for cell in driver.execute_script("""
        return [...document.querySelectorAll('#matrix-table td.cell[data-status]')].map((td) => ({
            row: td.parentElement.dataset.row, stack: td.dataset.stack, text: td.innerText.trim()}));""")}


def visible_rows(driver: WebDriver) -> list[str]:
    return driver.execute_script("return [...document.querySelectorAll('#matrix-table tbody tr')]"
                                 ".map((tr) => tr.dataset.row)")


def cell_button(driver: WebDriver, row: str, stack: str) -> WebElement:
    return driver.find_element(By.CSS_SELECTOR, f'#matrix-table tr[data-row="{row}"] td[data-stack="{stack}"] button')


def evidence_rows(driver: WebDriver) -> list[list[str]]:
    return driver.execute_script("return [...document.querySelectorAll('#matrix-evidence tbody tr')]"
                                 ".map((tr) => [...tr.cells].map((td) => td.innerText.trim()))")


def test_every_input_has_a_label(browser: WebDriver, server: str) -> None:
    viewport(browser, WIDE)
    open_view(browser, server, "matrix")
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, select, textarea')]"
        ".filter((e) => e.labels.length === 0).map((e) => e.id || e.name || e.outerHTML)")
    assert unlabelled == []
    assert browser.execute_script("return document.querySelectorAll('#verify-ops input').length") == len(
        api(server, "/ops"))
    assert console_errors(browser) == []


def test_matrix_heatmap_shows_each_cell_and_its_evidence(browser: WebDriver, server: str) -> None:
    viewport(browser, WIDE)
    open_view(browser, server, "matrix")
    entries = api(server, "/matrix")
    grid = rendered_grid(browser)
    assert grid == expected_grid(entries)
    # What PyTorch 2.13 does under vmap: the in-place composite raises, native falls back to the slow loop.
    assert grid[("masked_fill/functional", "vmap")] == "ok"
    assert grid[("masked_fill/functional", "vmap(grad)")] == "ok"
    assert grid[("masked_fill/mutating", "vmap")] == "error"
    assert grid[("masked_fill/native", "vmap")] == "slow"
    assert text(browser, "matrix-summary") == f"5 of 5 rows, 2 stacks, 10 measured cells ({len(entries)} entries)."

    cell_button(browser, "masked_fill/mutating", "vmap").click()
    assert text(browser, "evidence-title") == "masked_fill/mutating under vmap: error"
    stored = [e for e in entries if e["composite"] == "mutating" and _label(e["stack"]) == "vmap"]
    shown = evidence_rows(browser)
    assert sorted(row[0] for row in shown) == sorted(e["pattern"] for e in stored)
    failing = next(e for e in stored if e["status"] == "error")
    row = next(r for r in shown if r[0] == failing["pattern"])
    assert row[:4] == [failing["pattern"], "float32", failing["device"], "error"]
    assert row[4] == failing["detail"].strip() and "RuntimeError: vmap: inplace arithmetic" in row[4]
    assert row[5] == torch.__version__
    assert row[6] == measured_text(failing)
    assert failing["measured_at"] is not None and row[6].endswith(" UTC")  # verify stamps every entry
    passing = next(e for e in stored if e["status"] != "error")
    assert next(r for r in shown if r[0] == passing["pattern"])[4] == (
        f"{passing['detail']} (max abs error 0, max rel error 0)" if passing["detail"]
        else "max abs error 0, max rel error 0")

    # Keyboard: the grid is one tab stop; arrow keys move between cells; Enter shows a cell's evidence and moves the
    # focus there.
    assert browser.execute_script("return [...document.querySelectorAll('#matrix-table button')]"
                                  ".filter((b) => b.tabIndex === 0).map((b) => b.getAttribute('aria-label'))") == [
        "masked_fill/mutating under vmap: error; show evidence"]
    cell_button(browser, "masked_fill/native", "vmap").send_keys(Keys.ARROW_DOWN, Keys.ARROW_DOWN, Keys.ARROW_RIGHT,
                                                               Keys.ARROW_RIGHT, Keys.ARROW_UP, Keys.HOME)
    assert browser.execute_script("return document.activeElement.getAttribute('aria-label')") == (
        "masked_fill/mutating under vmap: error; show evidence")
    browser.switch_to.active_element.send_keys(Keys.END, Keys.ARROW_DOWN)
    assert browser.switch_to.active_element == cell_button(browser, "masked_fill/functional", "vmap(grad)")
    browser.switch_to.active_element.send_keys(Keys.ENTER)
    assert text(browser, "evidence-title") == "masked_fill/functional under vmap(grad): ok"
    assert browser.execute_script("return document.activeElement.id") == "matrix-evidence"
    assert {r[3] for r in evidence_rows(browser)} == {"ok"}
    assert {r[4] for r in evidence_rows(browser)} == {"max abs error 0, max rel error 0"}
    shoot(browser, "matrix-1280x800")

    Select(browser.find_element(By.ID, "matrix-status")).select_by_value("error")
    assert visible_rows(browser) == ["masked_fill/mutating"]
    Select(browser.find_element(By.ID, "matrix-status")).select_by_value("")
    Select(browser.find_element(By.ID, "matrix-kind")).select_by_value("functional")
    assert visible_rows(browser) == ["masked_fill/functional"]
    Select(browser.find_element(By.ID, "matrix-kind")).select_by_value("")
    Select(browser.find_element(By.ID, "matrix-op")).select_by_value("index_fill")
    assert visible_rows(browser) == []
    Select(browser.find_element(By.ID, "matrix-op")).select_by_value("masked_fill")
    assert visible_rows(browser) == ["masked_fill/native", "masked_fill/mutating", "masked_fill/functional",
                                     "masked_fill/primitive", "masked_fill/cpp_op"]
    assert console_errors(browser) == []


def decision_on_page(driver: WebDriver) -> dict[str, Any]:
    return driver.execute_script("""
        const facts = {};
        const dl = document.getElementById('decision-facts');
        for (const dt of dl.querySelectorAll('dt')) facts[dt.innerText.trim()] = dt.nextElementSibling.innerText.trim();
        return {
            composite: document.getElementById('decision-composite').innerText,
            reason: document.getElementById('decision-reason').innerText,
            facts,
            alternatives: [...document.querySelectorAll('#decision-alternatives tbody tr')]
                .map((tr) => [...tr.cells].map((td) => td.innerText.trim())),
        };""")


def assert_decision_matches(page: dict[str, Any], expected: dict[str, Any]) -> None:
    assert page["composite"] == expected["composite"]
    assert page["reason"] == expected["reason"]
    assert page["alternatives"] == [[a["composite"], a["kind"], "valid" if a["ok"] else "invalid", a["reason"]]
                                    for a in expected["alternatives"]]
    speedup = expected.get("speedup")
    assert page["facts"]["speedup over native"] == (f"{speedup:.2f}x" if speedup is not None else "not profiled")


def test_decision_explorer_takes_both_stack_spellings(browser: WebDriver, server: str) -> None:
    viewport(browser, WIDE)
    open_view(browser, server, "matrix")
    go(browser, "decide")
    Select(browser.find_element(By.ID, "decide-op")).select_by_value("index_fill")
    browser.find_element(By.CSS_SELECTOR, '#decide-batched-list input[value="value"]').click()
    Select(browser.find_element(By.ID, "decide-dtype")).select_by_value("float32")
    stack = browser.find_element(By.ID, "decide-stack")
    stack.send_keys("vmap(grad)", Keys.ENTER)  # Enter submits the form
    wait_for(browser, lambda d: d.find_element(By.ID, "decision").is_displayed(), "the decision")
    expected = api(server, "/select", op="index_fill", stack="vmap,grad", batched="value", dtype="float32")
    page = decision_on_page(browser)
    assert_decision_matches(page, expected)
    # The shipped reference profiles rank the C++ op first where it is built; the rules pick functional otherwise.
    chosen = "cpp_op" if kernels.fused_ops_available() else "functional"
    assert expected["composite"] == chosen
    verdicts = {"native": "invalid", "mutating": "invalid", "primitive": "valid", "functional": "valid",
                **CPP_OP_VERDICT}
    assert {a[0]: a[2] for a in page["alternatives"]} == {k: v for k, v in verdicts.items() if k != chosen}
    assert (page["facts"]["stack"], page["facts"]["batched"], page["facts"]["dtype"]) == (
        "vmap(grad)", "value", "float32")
    shoot(browser, "decision-1280x800")

    # The comma spelling, a measured op, and a pin.
    Select(browser.find_element(By.ID, "decide-op")).select_by_value("masked_fill")
    stack.clear()
    stack.send_keys("vmap")
    Select(browser.find_element(By.ID, "decide-pin")).select_by_value("primitive")
    browser.find_element(By.ID, "decide-submit").click()
    expected = api(server, "/select", op="masked_fill", stack="vmap", dtype="float32", pin="primitive")
    wait_for(browser, lambda d: decision_on_page(d)["reason"] == expected["reason"], "the pinned decision")
    assert_decision_matches(decision_on_page(browser), expected)
    assert expected["composite"] == "primitive"
    Select(browser.find_element(By.ID, "decide-pin")).select_by_value("")
    browser.find_element(By.ID, "decide-submit").click()
    expected = api(server, "/select", op="masked_fill", stack="vmap", dtype="float32")
    wait_for(browser, lambda d: decision_on_page(d)["reason"] == expected["reason"], "the measured decision")
    assert_decision_matches(decision_on_page(browser), expected)

    # Bad input: caught on the page (no request), or answered by the API's one-line error.
    stack.clear()
    stack.send_keys("vmap(grad", Keys.ENTER)
    wait_for(browser, lambda d: d.find_element(By.ID, "decide-error").is_displayed(), "the stack error")
    assert text(browser, "decide-error") == (
        'stack "vmap(grad": write nested calls like vmap(grad) or a list like vmap,grad')
    assert not browser.find_element(By.ID, "decision").is_displayed()
    stack.clear()
    stack.send_keys("vmap(gard)", Keys.ENTER)
    wait_for(browser, lambda d: "422" in d.find_element(By.ID, "decide-error").text, "the API's error")
    assert text(browser, "decide-error").startswith(
        "GET /select: 422 unknown transform 'gard' in stack 'vmap(gard)'; valid: vmap, grad")
    assert console_errors(browser) == [
        failed_request("/select?op=masked_fill&stack=vmap%2Cgard&policy=auto&dtype=float32", 422)]


def test_profiles_are_speedup_charts_over_native(browser: WebDriver, server: str) -> None:
    viewport(browser, WIDE)
    open_view(browser, server, "profiles")
    profiles = api(server, "/profiles", op="masked_fill")
    figure = browser.find_element(By.CSS_SELECTOR, 'figure[data-op="masked_fill"][data-workload="vmap"]')
    assert figure.find_element(By.TAG_NAME, "figcaption").text == "masked_fill under vmap"
    values = {t.get_attribute("data-composite"): t.text for t in figure.find_elements(By.CSS_SELECTOR, "text.value")}
    native = next(p for p in profiles if p["kind"] == "native")
    assert native["valid"], "the seeded native timing is the baseline of every bar"
    assert values == {p["composite"]: f"{native['median_us'] / p['median_us']:.2f}x" for p in profiles if p["valid"]}
    assert values["native"] == "1.00x"
    assert len(figure.find_elements(By.CSS_SELECTOR, "rect.bar")) == len(values)
    assert len(figure.find_elements(By.CSS_SELECTOR, "line.whisker")) == 3 * len(values)
    setting = figure.find_element(By.CSS_SELECTOR, "text.setting").text
    assert setting == f"batch 4 · {native['numel_bucket']} elements · float32 · cpu"
    shoot(browser, "profiles-1280x800")
    assert console_errors(browser) == []


def job_card(driver: WebDriver, kind: str, index: int = 0) -> WebElement:
    """The ``index``-th card of ``kind`` counting from the oldest."""
    cards = [c for c in driver.find_elements(By.CSS_SELECTOR, "#job-list li")
             if c.find_element(By.TAG_NAME, "strong").text == kind]
    return list(reversed(cards))[index]


def test_jobs_run_to_completion_and_cancel_from_the_page(browser: WebDriver, server: str) -> None:
    viewport(browser, WIDE)
    open_view(browser, server, "jobs")
    browser.find_element(By.CSS_SELECTOR, '#verify-ops input[value="index_fill"]').click()
    stacks = browser.find_element(By.ID, "verify-stacks")
    stacks.clear()
    stacks.send_keys("grad vmap(grad)")
    browser.find_element(By.ID, "verify-start").click()  # no token yet: auth is on
    wait_for(browser, lambda d: d.find_element(By.ID, "jobs-error").is_displayed(), "the 401")
    assert text(browser, "jobs-error") == "POST /verify: 401 this route needs the header Authorization: Bearer <token>"

    browser.find_element(By.ID, "job-token").send_keys(TOKEN)
    browser.find_element(By.ID, "verify-start").click()
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#job-list li"), "the job card")
    card = job_card(browser, "verify")
    job_id = card.get_attribute("id").removeprefix("job-")
    wait_for(browser, lambda d: job_card(d, "verify").get_attribute("data-state") == "done", "the verify job", 60)
    job = api(server, f"/jobs/{job_id}")
    assert job["state"] == "done" and job["params"]["stacks"] == ["grad", "vmap(grad)"]
    card = job_card(browser, "verify")
    assert card.find_element(By.CSS_SELECTOR, ".count").text == f"{job['done']}/{job['total']}"
    assert card.find_element(By.TAG_NAME, "progress").get_attribute("value") == str(job["total"])
    assert card.find_element(By.CSS_SELECTOR, ".job-params").text == "index_fill under grad, vmap(grad); float32"
    result = dict(zip([dt.text for dt in card.find_elements(By.CSS_SELECTOR, ".result dt")],
                      [dd.text for dd in card.find_elements(By.CSS_SELECTOR, ".result dd")], strict=True))
    assert result == {"entries": str(job["result"]["entries"]),
                      "statuses": ", ".join(f"{k} {v}" for k, v in job["result"]["statuses"].items())}
    # 5 composites x (grad: one unbatched pattern + vmap(grad): 4 batching patterns), every one of them served.
    assert job["result"]["entries"] == 25 == len(api(server, "/matrix", op="index_fill"))
    assert not card.find_elements(By.CSS_SELECTOR, "button.cancel")
    shoot(browser, "jobs-1280x800")

    # A profile long enough (4 composites timed for at least 1 s each) to still run while a verify waits behind it:
    # cancel the queued verify from the page.
    browser.find_element(By.CSS_SELECTOR, '#profile-ops input[value="index_fill"]').click()
    for field, value in (("profile-batches", "4"), ("profile-numels", "64"), ("profile-min-time", "1")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "profile-start").click()
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#job-list li")) == 2, "the profile card")
    browser.find_element(By.ID, "verify-start").click()
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#job-list li")) == 3, "the second verify card")
    queued = job_card(browser, "verify", 1)
    queued_id = queued.get_attribute("id").removeprefix("job-")
    assert queued.get_attribute("data-state") == "queued"
    queued.find_element(By.CSS_SELECTOR, "button.cancel").click()
    wait_for(browser, lambda d: job_card(d, "verify", 1).get_attribute("data-state") == "cancelled", "the cancel")
    assert api(server, f"/jobs/{queued_id}")["state"] == "cancelled"
    profile_id = job_card(browser, "profile").get_attribute("id").removeprefix("job-")
    # (A running job's Cancel stops it at its next case boundary: tests/service/test_jobs_end.py. This one runs on,
    # for the chart below.)
    wait_for(browser, lambda d: job_card(d, "profile").get_attribute("data-state") == "done", "the profile job", 60)
    profile_job = api(server, f"/jobs/{profile_id}")
    assert job_card(browser, "profile").find_element(By.CSS_SELECTOR, ".job-params").text == (
        "index_fill under vmap; batch 4; 64 elements; float32; cpu")
    assert (profile_job["params"]["workloads"], profile_job["params"]["dtypes"], profile_job["params"]["numels"]) == (
        ["vmap"], ["float32"], [64])
    assert job_card(browser, "profile").find_element(By.CSS_SELECTOR, ".count").text == (
        f"{profile_job['done']}/{profile_job['total']}")
    assert console_errors(browser) == [failed_request("/verify", 401)]

    # What the jobs wrote shows in the other views without a reload.
    go(browser, "matrix")
    wait_for(browser, lambda d: ("index_fill/functional", "grad") in rendered_grid(d), "the new matrix rows")
    assert {stack for (row, stack) in rendered_grid(browser) if row.startswith("index_fill/")} == {
        "grad", "vmap(grad)"}
    # A mismatch's detail states its errors; the evidence says them once.
    mismatch = next(e for e in api(server, "/matrix", op="index_fill") if e["status"] == "mismatch")
    assert "max abs error" in mismatch["detail"]
    cell_button(browser, f"index_fill/{mismatch['composite']}", _label(mismatch["stack"])).click()
    assert [r[4] for r in evidence_rows(browser) if r[0] == mismatch["pattern"]] == [mismatch["detail"].strip()]
    go(browser, "profiles")
    result = profile_job["result"]
    if result["profiles"]:
        wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, 'figure[data-op="index_fill"]'), "the new chart")
    else:  # every context measured disturbed (a loaded machine): refused by the noise control, so no chart
        assert result["refused"] and all("still disturbed" in reason for reason in result["refused"]), result
        assert not browser.find_elements(By.CSS_SELECTOR, 'figure[data-op="index_fill"]')
    assert console_errors(browser) == []

    # A reload keeps this tab's jobs, newest first, with their states (not the token).
    go(browser, "jobs")
    states = [(c.get_attribute("id"), c.get_attribute("data-state"))
              for c in browser.find_elements(By.CSS_SELECTOR, "#job-list li")]
    assert [s for _, s in states] == ["cancelled", "done", "done"]
    browser.refresh()
    wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ready") == "true", "the reload")
    assert [(c.get_attribute("id"), c.get_attribute("data-state"))
            for c in browser.find_elements(By.CSS_SELECTOR, "#job-list li")] == states
    assert browser.find_element(By.ID, "job-token").get_attribute("value") == ""
    assert console_errors(browser) == []


def test_checks_view_starts_a_check_and_shows_its_report(browser: WebDriver, server: str) -> None:
    viewport(browser, WIDE)
    open_view(browser, server, "checks")
    examples = api(server, "/checks/examples")
    options = browser.execute_script("return [...document.querySelectorAll('#check-example option')]"
                                     ".map((o) => [o.value, o.disabled])")
    assert options == [[e["name"], not e["available"]] for e in examples]
    assert text(browser, "checks-summary") == "The store holds no checks yet: start one above."
    go(browser, "jobs")
    browser.find_element(By.ID, "job-token").send_keys(TOKEN)
    go(browser, "checks")
    Select(browser.find_element(By.ID, "check-example")).select_by_value("index-fill")
    assert text(browser, "check-example-help").startswith("the README's example: index_fill")
    rounds = browser.find_element(By.ID, "check-rounds")
    rounds.clear()
    rounds.send_keys("1")
    browser.find_element(By.ID, "check-start").click()
    wait_for(browser, lambda d: d.find_element(By.ID, "check-detail").is_displayed(), "the check's report", 90)
    [listed] = api(server, "/checks")
    check = api(server, f"/checks/{listed['id']}")
    report = check["report"]
    assert text(browser, "check-summary") == report["summary"]
    assert report["summary"].startswith("native is silently wrong")
    runs = browser.execute_script("return [...document.querySelectorAll('#check-runs tbody tr')]"
                                  ".map((tr) => [...tr.cells].map((td) => td.innerText.trim()))")
    assert [row[:2] for row in runs] == [["native", "mismatch"], ["use()", "ok"]]
    assert [row[3] for row in runs] == ["result", "result"]
    # The chart's bars are the three timings on one linear axis.
    bars = browser.execute_script("return [...document.querySelectorAll('#check-timings rect')]"
                                  ".map((r) => [r.dataset.side, Number(r.getAttribute('width'))])")
    assert [side for side, _ in bars] == ["native", "use()", "reference"]
    times = {"native": check["native_s"], "use()": check["use_s"], "reference": check["reference_s"]}
    longest = max(times.values())
    widest = max(width for _, width in bars)
    for side, width in bars:
        assert width == pytest.approx(max(times[side] / longest * widest, 1), rel=1e-3, abs=0.5), side
    decisions = browser.execute_script("return [...document.querySelectorAll('#check-decisions tbody tr')]"
                                       ".map((tr) => [...tr.cells].map((td) => td.innerText.trim()))")
    assert [row[:5] for row in decisions] == [[d["op"], d["stack"], ", ".join(d["batched"]) or "none", d["composite"],
                                               d["kind"]] for d in report["decisions"]]
    table = browser.execute_script("return [...document.querySelectorAll('#checks-table tbody tr')]"
                                   ".map((tr) => [...tr.cells].map((td) => td.innerText.trim()))")
    assert table == [[measured_text(listed), "index-fill", "vmap(grad)", "mismatch", "ok", listed["summary"]]]
    shoot(browser, "checks")
    assert console_errors(browser) == []


def test_every_view_fits_400_px(browser: WebDriver, server: str) -> None:
    viewport(browser, NARROW)
    open_view(browser, server, "matrix")
    cell_button(browser, "masked_fill/mutating", "vmap").click()
    for view in ("matrix", "decide", "profiles", "checks", "jobs"):
        go(browser, view)
        if view == "decide":
            Select(browser.find_element(By.ID, "decide-op")).select_by_value("index_fill")
            browser.find_element(By.ID, "decide-stack").send_keys("vmap(grad)", Keys.ENTER)
            wait_for(browser, lambda d: d.find_element(By.ID, "decision").is_displayed(), "the decision")
        # The page never scrolls sideways: wide tables scroll inside their own box.
        assert browser.execute_script("return document.documentElement.scrollWidth") <= NARROW[0], view
        assert browser.find_element(By.ID, f"nav-{view}").get_attribute("aria-current") == "page"
        shoot(browser, f"{view}-400w")
    chart = browser.find_element(By.CSS_SELECTOR, "#profile-charts svg")
    assert int(chart.get_attribute("width")) <= NARROW[0]
    assert console_errors(browser) == []


def test_script_takes_either_shape_of_the_api(browser: WebDriver, server: str) -> None:
    """What the page must also read: stacks spelled `vmap(grad)`, paged lists, timestamps (issue 11's API shapes)."""
    viewport(browser, WIDE)
    open_view(browser, server, "matrix")
    parts = browser.execute_script("""return [["vmap", "grad"], "vmap,grad", "vmap(grad)", " vmap( grad ) ",
        "vmap(jvp(grad))", "", "eager", "grad"].map((s) => stackParts(s));""")
    assert parts == [["vmap", "grad"]] * 4 + [["vmap", "jvp", "grad"], [], [], ["grad"]]
    assert browser.execute_script("return [[], ['grad'], ['vmap', 'jvp', 'grad']].map(stackLabel)") == [
        "eager", "grad", "vmap(jvp(grad))"]
    errors = browser.execute_script("""return ["vmap(grad", "vmap)grad(", "vmap(,grad)", "vmap,,grad"].map((s) => {
        try { stackParts(s); return null; } catch (error) { return error.message; } });""")
    assert errors == [
        'stack "vmap(grad": write nested calls like vmap(grad) or a list like vmap,grad',
        'stack "vmap)grad(": write nested calls like vmap(grad) or a list like vmap,grad',
        'stack "vmap(,grad)": write nested calls like vmap(grad) or a list like vmap,grad',
        'stack "vmap,,grad" has an empty transform name',
    ]
    entries = [{"updated_at": "2026-11-30T17:05:09"}, {"updated_at": "2026-11-30 17:05:09.5+01:00"},
               {"measured_at": 1764522309}, {"created_at": "2026-11-30T17:05:09Z"}, {"updated_at": None}, {}]
    assert browser.execute_script("return arguments[0].map(measuredAt)", entries) == [
        measured_text(e) for e in entries]
    assert [measured_text(e) for e in entries] == ["2026-11-30 17:05:09 UTC", "2026-11-30 16:05:09 UTC",
                                                   "2025-11-30 17:05:09 UTC", "2026-11-30 17:05:09 UTC",
                                                   "not recorded", "not recorded"]
    # Paged answers are followed through next_cursor; the page asks with ?cursor=.
    paged = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const pages = {"": {items: [1, 2], next_cursor: "c1"}, "c1": {items: [3], next_cursor: "c 2"},
                       "c 2": {items: [], next_cursor: null}};
        const asked = [];
        const realFetch = window.fetch;
        window.fetch = async (url) => {
            asked.push(url);
            const cursor = new URL(url, location.href).searchParams.get("cursor") || "";
            return new Response(JSON.stringify(pages[cursor]), {status: 200});
        };
        getAll("/matrix", {op: "index_fill"}).then((items) => done({items, asked}))
            .catch((error) => done({error: error.message})).finally(() => { window.fetch = realFetch; });""")
    assert paged == {"items": [1, 2, 3], "asked": ["/matrix?op=index_fill", "/matrix?op=index_fill&cursor=c1",
                                                   "/matrix?op=index_fill&cursor=c+2"]}
    # A matrix whose stacks come as lists (the API before issue 11) renders in the same columns.
    browser.execute_script("""state.matrix = state.matrix.map((e) => ({...e, stack: stackParts(e.stack)}));
        renderMatrix();""")
    assert rendered_grid(browser) == expected_grid(api(server, "/matrix"))
    assert console_errors(browser) == []
