"""The quickstart's road through the UIs, walked in a real browser (headless Chromium, driven by
Playwright): from the URL `make ui` prints to the run, from the run's description to its Prefect
flow run, from the flow run's summary to the model version, and from the CLI's "View at" link to
that flow run. Each page's visible text is checked against the stores (MLflow's database, the
Prefect API, the stage folders), not only its HTTP status.

Screenshots of each page go to `$SFTFLOW_SCREENSHOTS` when set (else the test's folder), so a
person can look at the road as the test saw it."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import sftflow, tiny_config_dict, wait_healthy, write_config

pytestmark = pytest.mark.slow  # the whole flow, a kept Prefect server, the MLflow UI and a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Debian's Chromium, run as root in a sandboxed machine with no network (the flags the machine's
# notes give: without the background-networking ones it keeps dialling Google and being refused)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PAGE_MS = 90_000  # a page's first render on 2 busy cores (both UIs are single-page apps)


def _browser_missing() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (`make install` installs the dev extras)"
    if CHROMIUM is None:
        return "no chromium on PATH (`apt-get install chromium`; .ci/run installs it)"
    return None


def _unused_port() -> int:
    """The MLflow UI's port must be known before the run (registry.ui_url goes into its links), and
    `make ui` takes a number: one the kernel just handed out is the best guess there is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def road(tmp_path_factory):
    """A finished `sftflow run` on the kept Prefect server (which serves its UI), and the MLflow UI
    started the way `make ui CONFIG=...` starts it; both stopped at the end."""
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {missing}")
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("road")
    port = _unused_port()
    cfg = tiny_config_dict(tmp, registry={"model_name": "ui-road", "promote": "if_better",
                                          "ui_url": f"http://127.0.0.1:{port}"})
    cfg_path = write_config(tmp, cfg)
    env = {"PREFECT_API_URL": None, "SFTFLOW_KEEP_SERVER": "900"}  # this test's own kept server
    run = sftflow("run", "-c", str(cfg_path), cwd=tmp, env=env)
    assert run.returncode == 0, run.stderr[-3000:]

    ui_env = {**os.environ, "PREFECT_HOME": str(tmp / ".prefect")}
    ui_env.pop("PREFECT_API_URL", None)
    log = tmp / "mlflow-ui.log"
    ui = subprocess.Popen([sys.executable, "-m", "stages.tracking.ui", str(cfg_path), "--port", str(port)],
                          cwd=tmp, env=ui_env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                          start_new_session=True)
    try:
        first_line = ui.stdout.readline()
        wait_healthy(f"http://127.0.0.1:{port}/health", ui, log)
        yield {"tmp": tmp, "cfg": cfg_path, "run": run, "ui_line": first_line, "ui_port": port,
               "shots": Path(os.environ.get("SFTFLOW_SCREENSHOTS") or tmp / "screenshots")}
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
        sftflow("stop-server", "-c", str(cfg_path), cwd=tmp)


def _facts(road) -> dict:
    """What the pages must show, read from the stores themselves."""
    from mlflow.tracking import MlflowClient
    tmp = road["tmp"]
    artifacts = tmp / "artifacts"
    registration = json.loads(next((artifacts / "register").glob("*/registration.json")).read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}")
    run = client.get_run(registration["run_id"])
    kept = json.loads((tmp / ".prefect" / "server.json").read_text())
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    with urllib.request.urlopen(f"{kept['api']}/flow_runs/{flow_run_id}", timeout=30) as r:
        flow_run = json.loads(r.read())
    metrics = json.loads(next((artifacts / "evaluate").glob("*/metrics.json")).read_text())
    version = client.get_model_version("ui-road", str(registration["version"]))
    return {"run": run, "registration": registration, "flow_run": flow_run,
            "prefect_ui": kept["api"].removesuffix("/api"), "metrics": metrics, "version": version,
            "aliases": client.get_registered_model("ui-road").aliases}


def test_the_quickstart_road_in_a_browser(road):
    from playwright.sync_api import expect, sync_playwright

    facts = _facts(road)
    run, reg, flow_run = facts["run"], facts["registration"], facts["flow_run"]
    run_name, flow_run_name = run.info.run_name, flow_run["name"]
    assert facts["aliases"] == {"champion": reg["version"]}  # the first version of a model becomes champion

    # 1. The URL `make ui` prints: the config's experiment's runs list
    printed = re.search(r"(http://\S+)", road["ui_line"])
    assert printed and "experiment 'sftflow'" in road["ui_line"], road["ui_line"]
    ui_url = printed.group(1)
    assert ui_url.startswith(f"http://127.0.0.1:{road['ui_port']}/#/experiments/{run.info.experiment_id}/runs")
    cli_links = re.findall(r"View at (\S+)", road["run"].stdout + road["run"].stderr)
    assert cli_links, "a run on the kept server prints its flow run's link"

    shots = road["shots"]
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(PAGE_MS)
        expect.set_options(timeout=PAGE_MS)
        page = context.new_page()

        page.goto(ui_url)
        runs_list = page.get_by_role("link", name=run_name)
        expect(runs_list).to_be_visible()
        expect(page.get_by_text("1 matching run")).to_be_visible()
        page.screenshot(path=shots / "1-mlflow-runs.png")

        # 2. The run: its description names what was trained and links its flow run and version
        runs_list.click()
        expect(page.get_by_text("Prefect flow run:")).to_be_visible()
        body = page.inner_text("body")
        assert run_name in body
        assert f"Model version: ui-road v{reg['version']}" in body
        assert f"Train fingerprint: {run.data.tags['sftflow.train_fingerprint']}" in body
        for key in ("train/loss", "val/loss", "eval/accuracy", "eval/delta_low"):
            assert key in body and repr(run.data.metrics[key]) in body, key  # the run's numbers, as stored
        page.screenshot(path=shots / "2-mlflow-run.png", full_page=True)

        flow_link = page.get_by_role("link", name=flow_run["id"])
        assert flow_link.get_attribute("href") == run.data.tags["prefect.flow_run_url"]
        assert flow_link.get_attribute("href").startswith(facts["prefect_ui"] + "/")
        with context.expect_page() as opened:  # description links open in a new tab
            flow_link.click()
        prefect_page = opened.value

        # 3. The flow run in the Prefect UI: its name, its state, its stages
        expect(prefect_page.get_by_text(flow_run_name, exact=True).first).to_be_visible()
        expect(prefect_page.get_by_text("Completed", exact=True).first).to_be_visible()
        expect(prefect_page.get_by_text("register done ->").first).to_be_visible()  # the logs arrive last
        graph_and_logs = prefect_page.inner_text("body")
        for stage in ("prepare", "baseline", "train", "evaluate", "register"):
            assert f"{stage} done" in graph_and_logs, stage  # each stage's log line, from this run
        prefect_page.screenshot(path=shots / "3-prefect-flow-run.png")

        # 4. Its summary artifact: the stages, the eval table and the links into MLflow
        prefect_page.get_by_text("Artifacts", exact=True).first.click()
        prefect_page.get_by_text("sftflow-summary", exact=True).click()
        version_link = prefect_page.get_by_role("link", name=reg["model_uri"])
        expect(version_link).to_be_visible()
        summary = prefect_page.inner_text("body")
        val = facts["metrics"]  # the primary set's change vs the base model, with its 95% interval
        interval = f"[{val['delta_low']:+.3f}, {val['delta_high']:+.3f}]"
        assert interval in summary, (interval, summary[:2000])
        assert f"{run.info.run_id}" in summary and "aliases: champion" in summary
        prefect_page.screenshot(path=shots / "4-prefect-summary.png", full_page=True)

        assert version_link.get_attribute("href") == reg["version_url"]
        with context.expect_page() as opened:
            version_link.click()
        version_page = opened.value

        # 5. The model version in MLflow's registry: its number, its alias, the run it came from
        expect(version_page.get_by_text(f"Version {reg['version']}", exact=True)).to_be_visible()
        expect(version_page.get_by_text("champion").first).to_be_visible()
        expect(version_page.get_by_role("link", name=run_name)).to_be_visible()
        assert facts["version"].tags["sftflow.train_fingerprint"] in version_page.inner_text("body")
        version_page.screenshot(path=shots / "5-mlflow-version.png")

        # 6. The CLI's "View at" link: a page that shows that flow run
        cli_page = context.new_page()
        cli_page.goto(cli_links[-1])
        expect(cli_page.get_by_text(flow_run_name, exact=True).first).to_be_visible()
        assert cli_links[-1].rsplit("/", 1)[-1] == flow_run["id"]
        expect(cli_page.get_by_text("register done ->").first).to_be_visible()
        cli_page.screenshot(path=shots / "6-prefect-view-at.png")
        browser.close()
