"""The web page in a real browser: Debian's headless Chromium driven by playwright.

A real cluster runs a job with completed checkpoints and a failed savepoint; the page served by
the JobManager at ``/`` must show the cluster, the job and the checkpoint history with the values
the REST API and the gRPC API give, draw the chart from them, list every subtask's ack with sync
and async times, and show a checkpoint taken after it loaded without being reloaded.

The browser is /usr/bin/chromium (``make browser-deps`` installs Debian's chromium and
chromium-driver; ``playwright install`` is never used). Run through ``make test`` (or on CI) a
missing browser fails the test; run directly, it is skipped with the target to run.
``KEYEDSTATE_UPDATE_SCREENSHOT=1`` writes the page's screenshot to docs/img/web-ui.png.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from tests.fixtures.cluster import InProcessCluster
from tests.integration.rest.conftest import (
    JOB,
    MAX_P,
    OPERATORS,
    RestCluster,
    complete_checkpoint,
    failed_savepoint,
    start_rest_cluster,
    write_keys,
)

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[3] / "docs" / "img" / "web-ui.png"
SUBTASKS = sum(op.parallelism for op in OPERATORS)


def _browser_missing(message: str) -> None:
    # Through the Makefile (MAKELEVEL is set for its recipes) or on CI, a missing browser is a failure.
    if "MAKELEVEL" in os.environ or os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the web UI test cannot run: {message}; `make browser-deps` installs it", pytrace=False)
    pytest.skip(f"the web UI test needs {message}: run `make browser-deps`")


@pytest.fixture
def page() -> Iterator[Page]:
    if not os.access(CHROMIUM, os.X_OK):
        _browser_missing(f"Debian's chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _browser_missing("the playwright package (the dev extra)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


def _attr(node: Locator, name: str) -> str:
    value = node.get_attribute(name)
    assert value is not None, f"the chart's point has no {name}"
    return value


def _cells(page: Page, selector: str) -> list[list[str]]:
    rows = page.locator(selector)
    return [[c.strip() for c in rows.nth(i).locator("td").all_inner_texts()] for i in range(rows.count())]


def test_the_page_shows_the_cluster_jobs_and_checkpoints_and_refreshes_by_itself(
    inprocess_cluster: Callable[..., InProcessCluster], page: Page, tmp_path: Path
) -> None:
    rc: RestCluster = start_rest_cluster(inprocess_cluster)
    client = rc.client
    client.submit_job(JOB, OPERATORS, max_parallelism=MAX_P)
    completed = []
    for tag in range(1, 4):
        write_keys(client, JOB, 400 * tag, tag)
        completed.append(complete_checkpoint(client))
    failed = failed_savepoint(client)
    p = page

    p.goto(rc.url("/"))
    p.wait_for_selector("#job-table tbody tr[data-job]")
    p.wait_for_selector(f'#chk-history tr[data-checkpoint-id="{failed}"]')

    # The cluster: two TaskManagers, their slots, the free ones.
    assert p.inner_text("#tm-count") == "2"
    assert p.inner_text("#slots-total") == "8"
    assert p.inner_text("#slots-free") == str(8 - SUBTASKS)
    tms = _cells(p, "#taskmanagers tbody tr")
    assert sorted(r[0] for r in tms) == ["tm-0", "tm-1"]
    assert all(r[2] == "ACTIVE" and r[3] == "4" for r in tms)
    assert all(r[7] == "–" for r in tms)  # no slot processes: each TaskManager serves its slots itself
    assert sum(int(r[4]) for r in tms) == 8 - SUBTASKS

    # The job: status, restarts, routing version as the gRPC API reports them.
    info = client.job_info(JOB)
    (job,) = _cells(p, "#job-table tbody tr")
    assert job[0] == JOB and job[1] == "RUNNING"
    assert job[2] == f"{SUBTASKS}/{SUBTASKS}"
    assert job[3] == str(info.restarts) and job[4] == str(info.routing_version)
    assert job[7] == str(info.latest_checkpoint_id) == str(completed[-1])

    # The history: newest first, the failed savepoint with its reason, sizes and durations shown.
    listed = {c.checkpoint_id: c for c in client.list_checkpoints(JOB).checkpoints}
    history = _cells(p, "#chk-history tbody tr")
    assert [int(r[0]) for r in history] == [failed, *reversed(completed)]
    assert history[0][1] == "FAILED" and history[0][2] == "SAVEPOINT"
    assert history[0][9].startswith("CHECKPOINT_DECLINED: ") and "cannot write" in history[0][9]
    for row in history[1:]:
        assert row[1] == "COMPLETED" and row[7] == f"{SUBTASKS}/{SUBTASKS}"
        assert row[4] != "–" and row[5] != "–" and row[6] != "–"
    assert p.inner_text("#count-completed") == "3" and p.inner_text("#count-failed") == "1"

    # The chart: one duration point per finished checkpoint, one size point per completed one,
    # carrying the real values.
    durations = p.locator("#chk-chart circle.pt-duration")
    assert durations.count() == 4
    drawn = {
        int(_attr(durations.nth(i), "data-checkpoint-id")): int(_attr(durations.nth(i), "data-duration"))
        for i in range(4)
    }
    for cid in completed:
        assert drawn[cid] == listed[cid].duration_ms
    sizes = p.locator("#chk-chart circle.pt-size")
    drawn_sizes = [int(_attr(sizes.nth(i), "data-size")) for i in range(sizes.count())]
    assert drawn_sizes == [listed[c].full_size for c in completed] and drawn_sizes == sorted(drawn_sizes)
    assert p.locator("#chk-chart polyline.line-duration").count() == 1

    # Acks of the latest completed checkpoint (a click selects it): every subtask, sync and async.
    p.click(f'#chk-history tr[data-checkpoint-id="{completed[-1]}"]')
    p.wait_for_function(
        f"document.querySelector('#acks-checkpoint').textContent === '#{completed[-1]}' && "
        f"document.querySelectorAll('#acks tbody tr').length === {SUBTASKS}"
    )
    acks = _cells(p, "#acks tbody tr")
    assert sorted((r[0], int(r[1])) for r in acks) == sorted(
        (op.operator_id, i) for op in OPERATORS for i in range(op.parallelism)
    )
    assert all(r[2] == "completed" and (r[5].endswith(" ms") or r[5].endswith(" s")) for r in acks)
    assert all(r[6] != "–" and r[8] != "–" for r in acks)

    # It refreshes by itself: a checkpoint taken now appears without a reload.
    refreshes = int(p.evaluate("document.body.dataset.refreshes"))
    write_keys(client, JOB, 2000, 9)
    newest = client.trigger_checkpoint(JOB, timeout_s=120)
    assert newest.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, newest.failure_reason
    p.wait_for_selector(f'#chk-history tr[data-checkpoint-id="{newest.checkpoint_id}"]', timeout=30_000)
    assert int(p.evaluate("document.body.dataset.refreshes")) > refreshes
    assert p.locator("#chk-chart circle.pt-duration").count() == 5

    p.click(f'#chk-history tr[data-checkpoint-id="{newest.checkpoint_id}"]')
    p.wait_for_function(f"document.querySelector('#acks-checkpoint').textContent === '#{newest.checkpoint_id}'")
    shot = tmp_path / "web-ui.png"
    p.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("KEYEDSTATE_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)


def test_the_page_shows_each_taskmanagers_slot_processes(
    inprocess_cluster: Callable[..., InProcessCluster], page: Page
) -> None:
    """A TaskManager with ``taskmanager.slot-processes: 2`` next to one without: the page lists its two
    processes (index, address, pid, slots) as the TaskManager runs them, and "–" for the other."""
    cluster = inprocess_cluster(taskmanagers=1, slots=4, jm={"rest.port": 0})
    tm = cluster.add_taskmanager(**{"taskmanager.slot-processes": 2})
    cluster.client().wait_for_taskmanagers(2)
    assert tm.slot_processes is not None
    addresses, pids = tm.slot_processes.slot_addresses(), tm.slot_processes.pids()
    page.goto(f"http://127.0.0.1:{cluster.jobmanager.rest_port}/")
    page.wait_for_selector('#taskmanagers tbody tr[data-taskmanager="tm-1"]')
    rows = {r[0]: r for r in _cells(page, "#taskmanagers tbody tr")}
    assert rows["tm-0"][7] == "–"
    assert rows["tm-1"][7] == (
        f"#0 {addresses[0]} pid {pids[0]} (slots 0, 2); #1 {addresses[1]} pid {pids[1]} (slots 1, 3)"
    )


def test_the_page_asks_for_a_token_when_auth_is_on(
    inprocess_cluster: Callable[..., InProcessCluster], page: Page, tmp_path: Path
) -> None:
    """With security.auth.enabled the page loads, asks for a token, and shows the cluster once given one."""
    from tests.integration.security._tokens import make_tokens

    tokens = make_tokens(
        tmp_path / "auth", {"viewer": ("reader", ["*"]), "jm": ("jobmanager", ["*"]), "tm": ("taskmanager", ["*"])}
    )
    auth = {"security.auth.enabled": "true", "security.auth.tokens-file": str(tokens.tokens_file)}
    cluster = inprocess_cluster(
        taskmanagers=0, slots=2, jm={**auth, "rest.port": 0, "security.auth.token-file": tokens.file("jm")}
    )
    cluster.add_taskmanager(**auth, **{"security.auth.token-file": tokens.file("tm")})
    url = f"http://127.0.0.1:{cluster.jobmanager.rest_port}/"
    p = page
    p.goto(url)
    p.wait_for_selector("#login", state="visible")
    assert p.inner_text("#tm-count") == "–"
    p.fill("#token", tokens.tokens["viewer"])
    p.click("#login button")
    p.wait_for_function("document.querySelector('#tm-count').textContent === '1'")
    assert p.is_hidden("#login")
    assert p.inner_text("#slots-total") == "2"
