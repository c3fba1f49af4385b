"""The Prefect UI in a real browser: a headless Chromium (Debian's ``chromium``, driven by Playwright)
runs pipeline/tiny from the deployment's *Run → Custom run* form, as a user would.

A real ``prefect server start`` (its own UI, a fresh sqlite database, a free loopback port), the
``local-proc`` process pool (through the client, as ``prefect work-pool create`` makes it),
``prefect deploy --name tiny`` from the repository's prefect.yaml and a process worker (started once
the run is submitted: see the comment there); the server, deploy and worker each in its own process
group and always stopped. In the browser: Deployments →
tiny → Run → Custom run; the ``overrides`` JSON editor filled with fast offline values (those of
tests/test_deployments.py without post-training: committed corpus, one eval interval, no lm-eval,
no DP, no fine-tuning; ``config`` stays as deployed) and the ``run_dir`` field with a path under
tmp_path; Submit. The flow run must complete with exactly those parameters and write that run
directory; its page shows the task runs, and its Artifacts tab the report artifact, which opens with
every figure of the report drawn in it, and the live loss chart the pretraining refreshed.
What a user sees is checked on the way: no API call of a page fails while it loads (status >= 400 or
no answer; :data:`BENIGN_REQUEST_FAILURES` names the one exception), the Deployments list is not
empty and holds the deployment, the deployment's parameters are configs/tiny.yaml as loaded by
configs/schema.py and the form shows its values. Chromium starts with :data:`CHROMIUM_ARGS` (what
root in a container needs) and a fresh profile, checked on chrome://version. Screenshots of each step go to
build/ui-screenshots/ (the path is printed). About 100 s on 2 idle CPU cores, most of it the flow
run. Deselect with ``-m "not browser"``.

Chromium: ``make browser`` (``make test`` runs it) installs Debian's package as root; without it the
test is skipped, or fails when ``CI`` is set. Never ``playwright install`` (downloads).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from configs.base import field_title
from reports.artifacts import artifact_key
from tests.test_deployments import FAST, RUN_TIMEOUT_S, _start, _stop, _tail

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))
SHOTS = REPO / "build" / "ui-screenshots"
UI_FAST = FAST  # what the test types into the overrides field
INSTALL_HINT = "`make browser` as root (apt-get install -y chromium)"
# Chromium as root in a container: no setuid sandbox (root cannot have one), no GPU, no reliance on a
# small /dev/shm; nothing that reaches out of the machine (component updates, sync, background
# requests, QUIC); no first-run dialogs. Each test gets a fresh --user-data-dir (Playwright's
# persistent context under tmp_path), so no profile of an earlier run is read.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--headless",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
# Failed API requests that are no fault: the browser aborts a page's requests still in flight when
# the test navigates away from it (net::ERR_ABORTED is Chromium's own cancel, no server answer).
# Every API response with status >= 400 is a fault: there is no exception for those.
BENIGN_REQUEST_FAILURES = ("net::ERR_ABORTED",)
# The custom-run form's fields checked against configs/tiny.yaml, as (label, dotted config key): the
# form shows them as the deployment's parameters; the whole config is compared through the API.
# Labels are the fields' titles (configs.base.field_title: "Sync every", "Token budget"); each of these
# differs from the schema's default in configs/tiny.yaml.
FORM_FIELDS = [
    (field_title(key.split(".")[1]), key) for key in ("diloco.learners", "diloco.sync_every", "train.token_budget")
]


def _unavailable(reason: str) -> None:
    """Skip, or fail under CI (where the browser check must really run)."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(api: str, server: subprocess.Popen, log: Path, deadline_s: float = 300) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > end:
            raise AssertionError(f"prefect server did not come up at {api}:\n{_tail(log)}")
        time.sleep(0.5)


@pytest.fixture
def chromium() -> str:
    """Debian's Chromium and Playwright, checked before any server starts."""
    path = shutil.which("chromium")
    if path is None:
        _unavailable(f"no `chromium` on PATH: install it with {INSTALL_HINT}")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("playwright is not installed: `make setup` installs it (a dev dependency)")
    return path


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory):
    """A real Prefect server (with its UI and its services, the scheduler among them) on a free
    loopback port, shared by this module's tests; yields (base URL, API URL, env for child processes)."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    base, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # a 503 (a database error a client may retry) is logged with its traceback, not only answered
        "PREFECT_API_LOG_RETRYABLE_ERRORS": "true",
        # the UI asks the server for its API URL: without this it is http://127.0.0.1:4200/api
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        # the scheduler looks for schedules to fill every 5 s, not 60 (the schedule test)
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
        "PWD": str(REPO),
    }
    log = tmp_path / "server.log"
    server = _start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log)
    try:
        _wait_healthy(api, server, log)
        yield base, api, env
    finally:
        _stop(server)


class _ApiWatch:
    """Every call of the page to the Prefect API that failed: a response with status >= 400, or a
    request that got no answer (bar :data:`BENIGN_REQUEST_FAILURES`), with the page it came from."""

    def __init__(self, page, api: str) -> None:
        self.page, self.api, self.failures = page, api, []
        page.on("response", self._response)
        page.on("requestfailed", self._failed)

    def _response(self, response) -> None:
        if response.url.startswith(self.api) and response.status >= 400:
            self.failures.append(
                f"{response.status} {response.request.method} {response.url[len(self.api) :]} (page {self.page.url})"
            )

    def _failed(self, request) -> None:
        failure = request.failure or ""
        if request.url.startswith(self.api) and not any(b in failure for b in BENIGN_REQUEST_FAILURES):
            self.failures.append(
                f"{request.method} {request.url[len(self.api) :]} failed: {failure} (page {self.page.url})"
            )

    def check(self, what: str) -> None:
        assert not self.failures, f"{what}: the UI's API calls failed: " + "; ".join(self.failures)


def _config_difference(deployed: dict, shipped: dict) -> str:
    """The dotted keys whose values differ between two configs, with both values ('' if none)."""
    from reports.common import flatten

    a, b = flatten(deployed, sep="."), flatten(shipped, sep=".")
    return "; ".join(
        f"{k}: {a.get(k, '(missing)')!r} deployed, {b.get(k, '(missing)')!r} in the shipped config"
        for k in sorted(set(a) | set(b))
        if a.get(k, "(missing)") != b.get(k, "(missing)")
    )


def _in_api(api: str, fn):
    """``fn(client)`` with a synchronous client of this server (not the session's test harness, if one
    is active; synchronous because Playwright's sync API runs an event loop in this thread)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        return fn(client)


@pytest.mark.browser
def test_custom_run_from_the_ui(chromium, ui_server, tmp_path, capsys):
    from playwright.sync_api import expect, sync_playwright
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    base, api, env = ui_server
    log = tmp_path / "worker.log"
    run_dir = tmp_path / "run-from-the-form"
    report_key = artifact_key("report", "tiny")
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):
        old.unlink()

    # What `prefect work-pool create local-proc --type process` does (tests/test_deployments.py runs the CLI).
    _in_api(
        api,
        lambda client: client.create_work_pool(
            WorkPoolCreate(
                name="local-proc", type="process", base_job_template=ProcessWorker.get_default_base_job_template()
            )
        ),
    )
    with sync_playwright() as pw, ExitStack() as stack:  # the stack closes first: browser, worker, deploy
        # deploy and the browser start side by side; the worker once the run is submitted (below)
        deploy = _start([PREFECT, "--no-prompt", "deploy", "--name", "tiny"], env, tmp_path / "deploy.log")
        stack.callback(_stop, deploy)
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        stack.callback(browser.close)
        page = browser.new_page()
        page.set_default_timeout(60_000)
        expect.set_options(timeout=60_000)  # not Playwright's 5 s: a loaded 2-core machine is slow to render
        page.goto("chrome://version")  # the command line Chromium really got
        command_line = page.locator("#command_line").inner_text()
        assert all(flag in command_line.split() for flag in CHROMIUM_ARGS), command_line
        assert f"--user-data-dir={tmp_path / 'chromium-profile'}" in command_line, command_line
        api_calls = _ApiWatch(page, api)
        shot = 0

        def snap(name: str) -> None:
            nonlocal shot
            shot += 1
            page.screenshot(path=SHOTS / f"{shot:02d}-{name}.png", animations="disabled")

        try:
            page.goto(base + "/")
            expect(page.get_by_role("link", name="Deployments", exact=True)).to_be_visible()
            api_calls.check("the dashboard")

            assert deploy.wait(timeout=180) == 0, f"prefect deploy failed:\n{_tail(tmp_path / 'deploy.log')}"
            # the deployment as deployed holds the shipped config (configs/tiny.yaml through configs/schema.py)
            from configs.load import CONFIG_DIR, load_config

            shipped = load_config(CONFIG_DIR / "tiny.yaml").model_dump(mode="json")
            deployed = _in_api(api, lambda client: client.read_deployment_by_name("pipeline/tiny")).parameters
            assert deployed.get("config") == shipped, (
                "pipeline/tiny's form differs from configs/tiny.yaml: "
                f"{_config_difference(deployed.get('config') or {}, shipped)}"
            )

            page.get_by_role("link", name="Deployments", exact=True).click()
            # the list a user sees holds the deployment (an empty list shows "Create a deployment to get started")
            listed = page.get_by_role("link", name="tiny", exact=True)
            expect(page.get_by_text("Create a deployment to get started")).to_have_count(0)
            expect(listed, "the Deployments page lists no deployment pipeline/tiny").to_be_visible()
            api_calls.check("the Deployments page")
            listed.click()
            expect(page.get_by_role("button", name="Run", exact=True)).to_be_visible()
            expect(page.get_by_text("flows/pipeline.py:pipeline")).to_be_visible()  # the entrypoint
            api_calls.check("the deployment's page")
            snap("deployment-tiny")

            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Custom run").click()
            # the form shows the shipped config's values (not the schema's defaults)
            for label, key in FORM_FIELDS:
                section, name = key.split(".")
                want = str(shipped[section][name])
                title = page.get_by_text(re.compile(rf"^{label} \(Optional\)$"))
                box = (
                    page.locator("div")
                    .filter(has=title)
                    .filter(has=page.locator("input, textarea"))
                    .last.locator("input, textarea")
                    .first
                )
                assert box.input_value() == want, (
                    f"the custom-run form shows {label} = {box.input_value()!r}; configs/tiny.yaml has {key} = {want}"
                )
            api_calls.check("the custom-run form")
            # overrides: a JSON editor (CodeMirror); the fast offline values replace its {}
            editor = (
                page.locator("div")
                .filter(has=page.get_by_text("overrides (Optional)", exact=True))
                .locator(".cm-content")
                .last
            )
            editor.click()
            page.keyboard.press("Control+a")
            page.keyboard.press("Delete")
            page.keyboard.insert_text(json.dumps(UI_FAST))  # inserted whole: no auto-closed brackets
            expect(editor).to_contain_text('"train.token_budget": 3072')
            # run_dir is Optional[str]: a "str | None" switch set to None; pick str, type a path
            field = (
                page.locator("div")
                .filter(has=page.get_by_text("run_dir (Optional)", exact=True))
                .filter(has=page.get_by_role("tablist"))
                .last
            )
            field.get_by_role("tab", name="str", exact=True).click()
            field.get_by_role("textbox").fill(str(run_dir))
            expect(field.get_by_role("textbox")).to_have_value(str(run_dir))
            snap("custom-run-form")

            def runs_of_this_form(client):
                from prefect.client.schemas.filters import FlowFilter, FlowFilterName

                runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pipeline"])))
                return [r for r in runs if r.parameters.get("run_dir") == str(run_dir)]

            # A click that lands while the form re-renders after the last edit can be lost (seen on a
            # loaded machine: no run, no toast, no error). Click again only while no run exists, so a
            # slow first submission is never doubled.
            toast = page.get_by_text("scheduled to start")
            for attempt in range(3):
                page.get_by_role("button", name="Submit", exact=True).click()
                try:
                    expect(toast).to_be_visible(timeout=20_000)  # the toast
                    break
                except AssertionError:
                    if attempt == 2 or _in_api(api, runs_of_this_form):
                        expect(toast).to_be_visible()  # a run exists (or the last try): the toast must come
                        break
            # The worker starts now, not before: each of its polls (every second here) writes to the
            # server's SQLite database, and a write that commits while the UI's create_flow_run is
            # between its read and its insert makes SQLite refuse the insert ("database is locked";
            # Prefect answers 503, its Python client retries, the UI does not: the user sees an
            # error and no run). docs/ui.md says so; a shared server should use PostgreSQL.
            worker = _start([PREFECT, "worker", "start", "--pool", "local-proc"], env, log)
            stack.callback(_stop, worker)
            view_run = page.get_by_role("link", name="View run")
            run_url = view_run.get_attribute("href")
            flow_run_id = run_url.rstrip("/").rsplit("/", 1)[-1]
            snap("submitted")

            def wait_final(client):
                end = time.monotonic() + RUN_TIMEOUT_S
                while True:
                    fr = client.read_flow_run(flow_run_id)
                    if (fr.state is not None and fr.state.is_final()) or time.monotonic() > end:
                        return fr
                    time.sleep(1)

            flow_run = _in_api(api, wait_final)
            assert flow_run.parameters.get("run_dir") == str(run_dir), flow_run.parameters
            assert flow_run.name == run_dir.name  # named as its run directory, not adjective-animal
            assert flow_run.parameters.get("overrides") == UI_FAST  # typed into the form
            assert flow_run.state is not None and flow_run.state.is_completed(), (
                f"flow run {flow_run.name}: {flow_run.state}\n{_tail(log)}"
            )
            assert (run_dir / "report" / "report.md").is_file(), f"no report in {run_dir}"

            page.goto(base + run_url if run_url.startswith("/") else run_url)
            expect(page.get_by_text(flow_run.name, exact=True).first).to_be_visible()
            expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
            page.get_by_role("tab", name="Task Runs").click()
            expect(page.get_by_role("link", name="report", exact=True).first).to_be_visible()
            snap("flow-run-completed")

            page.get_by_role("tab", name="Artifacts").click()
            card = page.get_by_role("link").filter(has=page.get_by_text(report_key, exact=True))
            expect(card).to_be_visible()
            expect(card).to_contain_text(str(run_dir))  # the description names the run directory
            snap("artifacts-tab")

            card.click()
            expect(page.get_by_role("heading", name="Run report: tiny")).to_be_visible()
            expect(page.get_by_text(str(run_dir)).first).to_be_visible()
            # its figures are in the page, drawn (inline PNGs: the files live on the worker's disk)
            figures = page.locator("img[src^='data:image/png']")
            pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
            expect(figures).to_have_count(len(pngs))  # every figure of report/ (the page may still render)
            page.wait_for_function(  # each decoded and drawn at its size
                "n => { const i = [...document.querySelectorAll(\"img[src^='data:image/png']\")];"
                " return i.length === n && i.every(x => x.complete && x.naturalWidth > 100); }",
                arg=len(pngs),
            )
            figures.first.scroll_into_view_if_needed()
            snap("report-artifact-figures")

            # the DiLoCo subflow run: its learner and syncer tasks
            def diloco_run(client):
                from prefect.client.schemas.filters import FlowFilter, FlowFilterName

                runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pretrain-diloco"])))
                return next(r for r in runs if r.parameters.get("run_dir") == str(run_dir))

            page.goto(
                (base + run_url if run_url.startswith("/") else run_url).replace(
                    flow_run_id, str(_in_api(api, diloco_run).id)
                )
            )
            page.get_by_role("tab", name="Task Runs").click()
            expect(page.get_by_role("link", name="syncer", exact=True)).to_be_visible()
            expect(page.get_by_role("link", name="learner", exact=False)).to_have_count(3)  # tiny: M = 3
            for m in range(3):
                expect(page.get_by_role("link", name=f"learner-{m}", exact=True)).to_be_visible()
            expect(page.get_by_text(f"pretrain-diloco-{run_dir.name}").first).to_be_visible()  # its name
            snap("learners-and-syncer")
            # its Artifacts tab: the live chart it refreshed while it trained, drawn
            page.get_by_role("tab", name="Artifacts").click()
            live = page.get_by_role("link").filter(has=page.get_by_text(artifact_key("live", run_dir.name), exact=True))
            expect(live.first).to_be_visible()  # one card per version: one per evaluation of Θ
            live.first.click()
            # its key's page: a timeline of its versions, newest first; open the newest
            page.get_by_role("link", name=artifact_key("live", run_dir.name), exact=True).first.click()
            page.locator("a[href*='/artifacts/artifact/']").first.click()
            chart = page.locator("img[src^='data:image/png']").first
            expect(chart).to_be_visible()
            assert chart.evaluate("i => i.complete ? i.naturalWidth : 0") > 100
            budget = f"{UI_FAST['train.token_budget']:,} tokens"  # the last evaluation's point
            expect(page.get_by_text(re.compile(rf"Latest held-out loss: diloco: [0-9.]+ at {budget}"))).to_be_visible()
            snap("live-chart")
            api_calls.check("the flow run's pages")
        except BaseException:
            try:
                page.screenshot(path=SHOTS / "failure.png")
            except Exception:  # the page may be gone; keep the original error
                pass
            raise
        finally:
            with capsys.disabled():
                print(f"\nUI screenshots: {SHOTS}/", flush=True)


@pytest.mark.browser
def test_an_activated_schedule_creates_flow_runs(ui_server):
    """The sweep deployments' schedules are inactive as shipped (tests/test_deployments.py checks
    sweep/nightly's, deployed from prefect.yaml); here a sweep deployment with a short interval
    schedule, inactive, gets no run; `prefect deployment schedule resume` (the README's command)
    activates it, and the server's scheduler creates its flow runs, with the deployment's sweep."""
    import datetime as dt

    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.schedules import IntervalSchedule

    from configs.specs import load_spec

    _, api, env = ui_server
    spec = load_spec("sweep", "tiny_grid").model_dump(mode="json")

    def create(client):
        flow_id = client.create_flow_from_name("sweep")
        dep_id = client.create_deployment(
            flow_id=flow_id,
            name="every-10s",
            entrypoint="flows/sweep.py:sweep",
            parameters={"spec": spec},
            schedules=[
                DeploymentScheduleCreate(schedule=IntervalSchedule(interval=dt.timedelta(seconds=10)), active=False)
            ],
        )
        return dep_id, client.read_deployment(dep_id).schedules

    def runs_of(dep_id):
        return lambda client: client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id]))
        )

    dep_id, schedules = _in_api(api, create)
    assert [(s.active, s.schedule.interval) for s in schedules] == [(False, dt.timedelta(seconds=10))]
    listed = subprocess.run(
        [PREFECT, "deployment", "schedule", "ls", "sweep/every-10s"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0 and "10" in listed.stdout, listed.stdout + listed.stderr
    time.sleep(6)  # longer than the scheduler's loop for recently changed deployments (5 s)
    assert _in_api(api, runs_of(dep_id)) == []  # inactive: nothing scheduled

    resumed = subprocess.run(
        [PREFECT, "deployment", "schedule", "resume", "sweep/every-10s", str(schedules[0].id)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    end = time.monotonic() + 60
    while not (runs := _in_api(api, runs_of(dep_id))) and time.monotonic() < end:
        time.sleep(1)
    assert runs, "the activated schedule created no flow run within 60 s"
    assert all(r.state.is_scheduled() and r.parameters == {"spec": spec} for r in runs)
    starts = sorted(r.expected_start_time for r in runs)
    assert all(b - a == dt.timedelta(seconds=10) for a, b in zip(starts, starts[1:]))  # the interval
