"""The live status page in a real headless Chromium (Debian's chromium + chromium-driver, via selenium)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from diloco_testbed.prereq import unavailable

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import Learner, encode_grad, initial_params, outer_grad, tiny_plan

pytestmark = [pytest.mark.integration, pytest.mark.browser]
PLAN = tiny_plan()


@pytest.fixture
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        unavailable("headless Chromium is needed: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


_CELLS = """return Array.from(document.querySelectorAll(arguments[0])).map(
    (tr) => Array.from(tr.querySelectorAll("td")).map((td) => td.innerText.trim()));"""


def cell_texts(driver: object, table: str) -> list[list[str]]:
    """The cell texts of a table's body, read in one script call: the page re-renders its tables
    while it refreshes, so elements found in one call may be gone (stale) by the next."""
    rows: list[list[str]] = driver.execute_script(_CELLS, f"#{table} tbody tr")  # type: ignore[attr-defined]
    return rows


def test_status_page_shows_learners_and_rounds(sync_factory: SyncFactory, browser: object) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    sync = sync_factory(args=["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1",
                              "--job-id", "page-test"])  # fmt: skip
    browser.get(f"{sync.url}/")  # type: ignore[attr-defined]
    wait = WebDriverWait(browser, 20, poll_frequency=0.2)
    wait.until(lambda d: d.find_element("id", "job").text == "page-test")
    assert cell_texts(browser, "learners") == []

    learner = Learner(sync.url, "island-a", PLAN)
    assert learner.register().status_code == 200
    assert learner.heartbeat(7, eval_loss=4.25).status_code == 200
    wait.until(lambda d: any(row[0] == "island-a" for row in cell_texts(d, "learners")))
    row = next(r for r in cell_texts(browser, "learners") if r[0] == "island-a")
    assert row[2] == "training"
    assert row[3] == "7"
    assert row[9] == "4.250"

    for p in (0, 1):
        assert learner.init(p, initial_params(PLAN, p)).status_code == 200
    wait.until(lambda d: [r[:2] for r in cell_texts(d, "fragments")] == [["0", "0"], ["1", "0"]])
    assert learner.contribute(1, 0, encode_grad(outer_grad(PLAN, 1, seed=1), 1, 0)).status_code == 202
    wait.until(lambda d: [r[:2] for r in cell_texts(d, "fragments")] == [["0", "0"], ["1", "1"]])
    wait.until(lambda d: len(cell_texts(d, "recent-rounds")) == 1)
    fragment, version, participants = cell_texts(browser, "recent-rounds")[0][:3]
    assert (fragment, version, participants) == ("1", "1", "island-a")
    assert browser.find_element("id", "rounds").text == "1"  # type: ignore[attr-defined]
    assert browser.find_element("id", "storage").text == "ok"  # type: ignore[attr-defined]
    learner.close()
