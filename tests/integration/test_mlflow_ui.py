"""What a person sees in the MLflow UI for a tiny PPO run: ``mlflow server`` on 127.0.0.1 over the
run's store, its run page in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, installed
by ``make browser``): the registered policy on the overview, metric charts, the samples table.

Screenshots go to the test's temporary folder; with ``UPDATE_SCREENSHOTS=1`` also to ``docs/``
(docs/howto/review_run.md shows them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from tests.processes import free_port, mlflow_server_env, stop, wait_http

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
MODEL = "tiny-reversal-policy"
ITERATIONS = 3
OVERRIDES = ["rollout.engine=hf", "rollout.prompts_per_iteration=8", "actor.nproc_per_node=1",
             "actor.minibatch_size=16", "actor.micro_batch_size=8", "critic.minibatch_size=16",
             "critic.micro_batch_size=8", f"run.num_iterations={ITERATIONS}", "run.eval_interval=1",
             "run.save_interval=2", "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8",
             f"run.registered_model_name={MODEL}"]
CHARTS = "rollout/(reward_mean|init_policy_kl|response_length_mean)|actor/loss"
"""Chart search on the Model metrics tab (a regular expression): reward, KL, length and loss."""


def _train(tmp) -> str:
    """A tiny PPO run through the tasks' own functions (one process, HF engine); its MLflow run id."""
    from models.training.distributed import DistInfo
    from models.stages.advantages import run_advantages
    from models.stages.commit import run_commit
    from models.stages.evaluate import run_evaluate
    from models.stages.finish import run_finish
    from models.stages.rollout import run_rollout
    from models.stages.score import run_score
    from models.run.setup import setup_run
    from models.stages.actor import train_actor
    from models.stages.critic import train_critic

    setup = setup_run("tiny_ppo", [f"run.storage_root={tmp}/runs"] + OVERRIDES, "tiny-review", "ppo")
    cfg, run, state = setup
    cpu = DistInfo(0, 1, 0, torch.device("cpu"))
    for _ in range(ITERATIONS):
        ro = run_rollout(cfg, run, state)
        sc = run_score(cfg, run, state, ro.batch)
        ad = run_advantages(cfg, run, state, sc.batch)
        actor, critic = train_actor(cfg, run, state, ad.batch, cpu), train_critic(cfg, run, state, ad.batch)
        state = run_commit(cfg, run, state, [ro.stats, sc.stats, ad.stats, actor.stats, critic.stats], sc.batch,
                           actor.checkpoint_url, critic.checkpoint_url)
        run_evaluate(cfg, run, state)
    return run_finish(cfg, run, state).mlflow_run_id


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(base URL, experiment id, run id, artifact folder)`` of ``mlflow server`` over a tiny run."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(DRIVER, os.X_OK)):
        pytest.fail(f"{CHROMIUM} / {DRIVER} missing: run `make browser` (make test does)")
    tmp = tmp_path_factory.mktemp("ui")
    db, artifacts = f"sqlite:///{tmp}/mlflow.db", tmp / "artifacts"
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", db)
    from models import tracking

    exp = tracking.client().create_experiment("flyte-rlhf", artifact_location=str(artifacts))
    run_id = _train(tmp)
    mp.undo()
    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--backend-store-uri", db, "--default-artifact-root", str(artifacts),
                             "--workers", "1"], env=mlflow_server_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/health", proc, "mlflow server", timeout_s=120)
        yield base, exp, run_id, artifacts
    finally:
        stop(proc, timeout_s=20)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1150"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _page_text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def _open(driver, url: str, ready, timeout: float = 90.0) -> None:
    """Load ``url`` and wait until ``ready(driver)``; close the assistant panel that hides part of the page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, timeout).until(ready)
    if driver.find_elements(By.XPATH, "//*[normalize-space(text())='Evaluation runs']"):  # the GenAI sidebar
        driver.find_element(By.XPATH, "//*[normalize-space(text())='Model training']").click()  # (remembered)
        driver.get(url)
        WebDriverWait(driver, timeout).until(ready)
    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        button.click()
    time.sleep(1.0)  # let the charts finish drawing after the layout change


def _screenshot(driver, tmp_path_factory, name: str) -> str:
    """Save a screenshot (palette PNG, small enough for the docs); also to docs/ with UPDATE_SCREENSHOTS=1."""
    from PIL import Image

    out = str(tmp_path_factory.getbasetemp() / f"{name}.png")
    driver.save_screenshot(out)
    Image.open(out).convert("RGB").quantize(colors=128).save(out, optimize=True)
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        shutil.copy(out, os.path.join(ROOT, "docs", f"{name}.png"))
    return out


def test_overview_shows_the_registered_policy_and_run_tags(server, browser, tmp_path_factory):
    base, exp, run_id, _ = server
    _open(browser, f"{base}/#/experiments/{exp}/runs/{run_id}", lambda d: "Registered models" in _page_text(d))
    from selenium.webdriver.common.by import By

    def versions_shown(d) -> bool:  # the row's placeholder until the model versions arrive
        after = _page_text(d).split("Registered models", 1)[-1]
        return MODEL in after and "v1" in after.split("Description", 1)[0]

    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 60).until(versions_shown, f"{MODEL} v1 should be listed under Registered models")
    heading = browser.find_element(By.XPATH, "//h4[normalize-space()='Registered models']")
    bottom = browser.execute_script("const r = arguments[0].getBoundingClientRect(); "
                                    "return window.innerHeight - r.bottom - 40;", heading)
    assert bottom > 0, "the registered model should be on screen without scrolling"
    text = _page_text(browser)
    assert "tiny-review" in text  # the run's name
    assert f"Run tiny-review finished: {ITERATIONS} iterations of ppo." in text  # the description
    for tag in ("algorithm", "preset", "git_commit", "flyte_execution_id"):
        assert tag in text
    assert "Finished" in text
    png = _screenshot(browser, tmp_path_factory, "mlflow_run_overview")
    assert 10_000 < os.path.getsize(png) < 300_000


def test_model_metrics_tab_draws_reward_kl_length_and_loss_charts(server, browser, tmp_path_factory):
    from selenium.webdriver.common.by import By

    base, exp, run_id, _ = server
    search = "input[placeholder='Search metric charts']"
    _open(browser, f"{base}/#/experiments/{exp}/runs/{run_id}/model-metrics",
          lambda d: d.find_elements(By.CSS_SELECTOR, search))
    browser.find_element(By.CSS_SELECTOR, search).send_keys(CHARTS)
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 4)

    def last_step_drawn(d) -> bool:  # the x axis's tick of the last iteration, once the charts are drawn
        return any(line.strip() == str(ITERATIONS - 1) for line in _page_text(d).splitlines())

    WebDriverWait(browser, 30).until(last_step_drawn, "the x axis should reach the last iteration's step")
    text = _page_text(browser)
    for chart in ("reward_mean", "init_policy_kl", "response_length_mean", "loss"):
        assert f"tiny-review (" in text and chart in text, chart
    assert "rollout/reward_std" not in text  # the search really narrowed the charts
    png = _screenshot(browser, tmp_path_factory, "mlflow_run_charts")
    assert 10_000 < os.path.getsize(png) < 300_000


def test_samples_table_matches_the_logged_samples(server, browser, tmp_path_factory):
    from selenium.webdriver.common.by import By

    base, exp, run_id, artifacts = server
    name = f"samples/iter-{ITERATIONS - 1:06d}.json"
    with open(artifacts / run_id / "artifacts" / name) as f:
        logged = json.load(f)  # pandas "split" layout: columns + data
    cols = logged["columns"]
    assert cols[:4] == ["prompt", "response", "reward", "kl"]
    assert {"reward_raw", "row_id"} <= set(cols)  # the reward before scaling, the sample's data row
    assert all(isinstance(r[cols.index("row_id")], int) for r in logged["data"])
    _open(browser, f"{base}/#/experiments/{exp}/runs/{run_id}/artifacts/{name}",
          lambda d: "View as table" in _page_text(d) and d.find_elements(By.CSS_SELECTOR, "table, [role='table']"))
    headers = [h.text.strip() for h in browser.find_elements(By.CSS_SELECTOR, "th, [role='columnheader']")]
    assert [h for h in headers if h] [:4] == ["prompt", "response", "reward", "kl"]
    text = _page_text(browser)
    first = logged["data"][0]
    assert first[0] in text and f"{first[2]:.4f}"[:5] in text
    png = _screenshot(browser, tmp_path_factory, "mlflow_samples_table")
    assert 10_000 < os.path.getsize(png) < 300_000
