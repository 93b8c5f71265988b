"""The Streamlit inspector on a ledger seeded by the real rollout path (LocalEngine, harness, learner).

Every page through `streamlit.testing.v1.AppTest`; untrusted text is escaped; the inspector cannot
write; and (slow) a headless Chromium opens a run, clicks into a trajectory and sees masked tokens.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import sqlalchemy as sa

from loopline.envregistry import registry
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.engines.thread import EngineThread
from loopline.rollout.harness.episode import EpisodeSetup
from loopline.rollout.engines.local import LocalEngine
from loopline.rollout.harness.scheduler import Binding
from loopline.store import ledger
from loopline.store.db import session as new_session
from loopline.tasks import loop as loop_tasks
from loopline.pipeline.learner_side import LearnerSide
from loopline.config import RolloutSettings
from loopline.pipeline.stages import LoopContext
from loopline.trainer.learner import Learner, LearnerConfig
from loopline.ports import free_port
from tests.helpers import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "loopline" / "ui" / "app.py")
SCRIPT = "<script>alert('owned')</script>"


@pytest.fixture(scope="module")
def seeded(tiny_dirs, database_url, tmp_path_factory):
    """Two RL steps of a run whose tasks include one with a script tag in its prompt."""
    engine = sa.create_engine(database_url)
    with new_session(engine) as s:
        ref = registry.add(s, ROOT / "examples" / "arithmetic_env.yaml").ref
        row = registry.get(s, ref)
        run = ledger.create_run(s, f"inspect-{os.getpid()}", {"learner": {"advantage": {"estimator": "grpo"}}}, str(tiny_dirs["v0"]))
    spec = registry.spec_of(row)
    tasks = [t for t in registry.tasks_of(row) if t.split == "train"][:2]
    tasks.append(Task("xss", "train", f"What is 1 + 1? {SCRIPT}", {"expression": "1 + 1", "answer": 2, "template": "a o b"}))
    ctx = LoopContext(
        run_id=run.id,
        session_factory=lambda: new_session(engine),
        engine=EngineThread(LocalEngine(tiny_dirs["v0"])),
        binding=Binding(EpisodeSetup(spec, row.version, ChatFormat.for_policy(tiny_dirs["v0"]), SamplingParams(max_new_tokens=16)), {t.id: t for t in tasks}),
        learning=LearnerSide(learner=Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3), backend="torch"), workdir=tmp_path_factory.mktemp("inspect")),
        rollout=RolloutSettings(groups_per_step=3, group_size=4, concurrency=16),
    )

    try:
        for step in (1, 2):  # the train flow's sync loop
            loop_tasks.plan_step.fn(ctx, step)
            loop_tasks.rollout_batch.fn(ctx, step)
            loop_tasks.learner_step.fn(ctx, step)
            loop_tasks.sync_weights.fn(ctx)
    finally:
        ctx.engine.shutdown()
    from loopline import plan

    cpu = plan.hardware("cpu")
    memory = plan.estimate(plan.ModelShape.from_dir(tiny_dirs["v0"]), plan.Workload(), cpu)
    with new_session(engine) as s:
        ledger.set_run_plan(s, run.id, memory.as_dict())
        ledger.record_served(s, run.id, "gpu-1:4242:77", ["http://gpu-1:30000"], 2)  # as a rollout worker on a GPU node does
        xss = s.execute(sa.text("SELECT id, group_id FROM trajectory WHERE run_id = :r AND task_id = 'xss' LIMIT 1"), {"r": run.id}).one()
    engine.dispose()
    return {"url": database_url, "run": run.name, "run_id": run.id, "xss": str(xss.id), "xss_group": str(xss.group_id), "env": ref}


@pytest.fixture
def app(seeded, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", seeded["url"])

    def open_page(page: str, **params: str) -> AppTest:
        at = AppTest.from_file(APP, default_timeout=60)
        at.query_params["page"] = page
        for key, value in params.items():
            at.query_params[key] = value
        at.run()
        assert not at.exception, at.exception
        return at

    return open_page


def _html(at) -> str:
    return "\n".join(m.value for m in at.markdown)


def test_runs_page_lists_the_run_with_its_curves(app, seeded):
    at = app("runs", run=seeded["run"])
    assert seeded["run"] in at.dataframe[0].value["name"].tolist()
    titles = [s.value for s in at.subheader]
    assert "Training reward" in titles and "Version lag of trained samples" in titles
    assert "Seconds per learner step, by part" in titles
    assert "|μ − π_old| per trajectory, by step (max over its tokens)" in titles
    worst = next(d.value for d in at.dataframe if "max_abs_diff" in d.value)
    assert len(worst) == 10 and (worst["max_abs_diff"].diff().dropna() <= 0).all()  # the worst first, with links
    memory = next(d.value for d in at.dataframe if "part" in d.value)
    assert {"weights", "optimizer states", "activations", "KV cache"} <= set(memory["part"]) and (memory["bytes"] > 0).all()
    assert any("planned" in c.value and "measured peak RSS" in c.value for c in at.caption)
    assert "Rollout engines and the version each serves (SGLang servers by URL; a process's own CPU engine as in-process)" in titles
    servers = next(d.value for d in at.dataframe if "served_version" in d.value)
    from loopline import holder

    assert servers[["url", "synced_by", "served_version"]].values.tolist() == [
        ["http://gpu-1:30000", "gpu-1:4242:77", 2], ["in-process", holder.this_process(), 2]]  # (this test's CPU engine, synced to v2)
    assert len(at.get("vega_lite_chart")) >= 6  # reward, throughput, step timings, degenerate rate, lags, failures, gap
    assert "Optimisation, per learner step" in titles
    captions = [c.value for c in at.caption]
    assert "loss" in captions and "gradient norm (before clipping)" in captions  # the learner's metrics the run recorded
    assert "policy entropy (mean over trained tokens)" in captions and "episodes cut by a budget (fraction)" in captions
    said = next(c for c in captions if c.startswith(f"{seeded['run']}: "))
    assert "learner step 2" in said and "redrawn" not in said, said  # not training: drawn once
    import yaml

    engine = sa.create_engine(seeded["url"])
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT config FROM run WHERE name = :n"), {"n": seeded["run"]}).scalar_one()
    engine.dispose()
    assert any(yaml.safe_load(c.value) == stored for c in at.code), [c.value for c in at.code]  # the run's stored config


def _chart_runs(chart) -> dict[str, int]:
    """The runs a chart draws, and how many points each (read from the data Streamlit sends the browser)."""
    import pyarrow as pa

    frames = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets]
    if chart.proto.HasField("data") and chart.proto.data.data:
        frames.append(pa.ipc.open_stream(chart.proto.data.data).read_all().to_pandas())
    runs = pd.concat([f for f in frames if "run" in f], ignore_index=True)["run"]
    return runs.value_counts().to_dict()


@pytest.fixture(scope="module")
def other_run(seeded):
    """A second run beside the seeded one: 3 steps of reward, 2 evaluations."""
    engine = sa.create_engine(seeded["url"])
    with new_session(engine) as s:
        other = ledger.create_run(s, f"{seeded['run']}-other", {"test": "compare"}, "file:///w")
        for step, reward in ((1, 0.1), (2, 0.3), (3, 0.5)):
            s.execute(sa.text("INSERT INTO metric (run_id, step, name, value) VALUES (:r, :s, 'reward_mean', :v)"), {"r": other.id, "s": step, "v": reward})
        s.commit()
        for version, wins in ((0, 1), (3, 6)):
            ledger.record_eval_result(s, other.id, version, "arithmetic", 1, 10, wins)
    engine.dispose()
    return other


def test_two_runs_compared_on_one_chart_each(app, seeded, other_run):
    """Users compare runs: reward per step and held-out success, one curve per run (issue 47, section 3)."""
    other = other_run
    engine = sa.create_engine(seeded["url"])
    at = app("runs", run=seeded["run"])
    at.multiselect(key="compare").set_value([seeded["run"], other.name]).run()
    assert not at.exception, at.exception
    summary = next(d.value for d in at.dataframe if "best held-out success" in d.value)
    mine = summary.set_index("run")
    assert mine.loc[other.name, "steps"] == 3 and mine.loc[other.name, "last training reward"] == pytest.approx(0.5)
    assert mine.loc[other.name, "best held-out success"] == pytest.approx(0.6) and mine.loc[other.name, "at version"] == 3
    assert mine.loc[seeded["run"], "steps"] == 2
    titles = [s.value for s in at.subheader]
    assert "reward_mean per learner step, by run" in titles and "Held-out success vs version, by run" in titles
    with engine.connect() as c:
        seeded_evals = c.execute(sa.text("SELECT count(*) FROM eval_result WHERE run_id = :r"), {"r": seeded["run_id"]}).scalar()
    engine.dispose()
    drawn = [_chart_runs(c) for c in at.get("vega_lite_chart") if '"run"' in c.proto.spec]
    assert {seeded["run"]: 2, other.name: 3} in drawn, drawn  # reward per step: 2 steps and 3
    assert {other.name: 2, **({seeded["run"]: seeded_evals} if seeded_evals else {})} in drawn, drawn  # held-out success


def test_trajectories_page_filters_and_opens_one(app, seeded):
    at = app("trajectories", run=seeded["run"])
    table = at.dataframe[0].value
    assert len(table) == 24 and set(table["split"]) == {"train"}  # 2 steps x 3 groups x 4 samples
    assert table["consumed"].all()
    at.selectbox[1].set_value("no").run()  # consumed: no -> nothing (every one was trained)
    assert len(at.dataframe[0].value) == 0
    assert not at.warning  # all 24 shown: nothing to say
    capped = app("trajectories", run=seeded["run"], limit="10")
    assert len(capped.dataframe[0].value) == 10 and "first 10 of 24" in capped.warning[0].value


def test_an_evaluations_held_out_episodes_are_listed_and_open_like_training_ones(app, seeded):
    """Issue 47: only training trajectories were browsable; an evaluation's episodes were counted and lost."""
    from tests.factories import trajectory

    engine = sa.create_engine(seeded["url"])
    with new_session(engine) as s:
        run = ledger.create_run(s, f"{seeded['run']}-evaluated", {"test": "eval episodes"}, "file:///w")
        episodes = [(f"e{i}", trajectory(reward=float(i % 2), seed=i)) for i in range(3)]
        assert ledger.record_eval_result(s, run.id, 2, "arithmetic", 1, 3, 1, {}, episodes=episodes, worker="w")
    engine.dispose()
    at = app("trajectories", run=run.name)
    table = at.dataframe[0].value
    assert sorted(table["task_id"]) == ["e0", "e1", "e2"] and set(table["split"]) == {"eval"} and set(table["step"]) == {2}
    assert not table["consumed"].any() and sorted(table["reward"]) == [0.0, 0.0, 1.0]
    opened = app("trajectory", id=str(table["id"].iloc[0]))
    assert not opened.exception, opened.exception
    assert "eval" in [m.value for m in opened.metric], [m.value for m in opened.metric]


def test_selecting_a_row_opens_its_trajectory(app, seeded):
    at = app("trajectories", run=seeded["run"])
    table = at.dataframe[0].value
    row = table.index[table["id"] == seeded["xss"]][0]
    at.session_state["trajectory-table-0"] = {"selection": {"rows": [int(row)], "columns": [], "cells": []}}  # a click on the row
    at.run()
    assert not at.exception, at.exception
    assert at.query_params["page"] == "trajectory" and at.query_params["id"] == seeded["xss"]
    assert at.header[0].value == f"Trajectory {seeded['xss']}"


def test_trajectory_page_shows_tokens_masks_and_escapes_untrusted_text(app, seeded):
    at = app("trajectory", id=seeded["xss"])
    page = _html(at)
    assert 'class="tok act"' in page and 'class="tok ctx"' in page  # action tokens vs context tokens
    assert "logprob" in page and "mask 1" in page
    shown = html.unescape(re.sub(r"<[^>]+>", "", page)).replace("⏎", "")
    assert SCRIPT in shown  # the prompt's script tag is there, as characters ...
    assert "<script" not in page.lower()  # ... and never as markup
    assert at.metric[1].value in ("passed", "task_failed", "truncated")
    assert not at.dataframe[0].value.empty  # the attempts at this slot


def test_tool_calls_show_their_output_also_when_they_failed_and_ids_read_as_text(app, seeded):
    """A tool call's output is what the agent was shown, failed or not (the page showed `error: False`
    instead of it), and the attempts table shows ids as text (Streamlit showed a UUID's bytes)."""
    engine = sa.create_engine(seeded["url"])
    events = [
        {"tool": "calc", "args": {"expression": "1 + 1"}, "output": "<result>2</result>", "error": False, "seconds": 0.01},
        {"tool": None, "args": None, "output": "unknown tool <bogus>", "error": True, "seconds": 0.0},
    ]
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE segment SET tool_events = CAST(:e AS jsonb) WHERE trajectory_id = :t AND seq = 0"),
            {"e": json.dumps(events), "t": seeded["xss"]},
        )
    engine.dispose()
    at = app("trajectory", id=seeded["xss"])
    shown = [c.value for c in at.code]
    assert "<result>2</result>" in shown and "unknown tool <bogus>" in shown
    assert not [c for c in shown if c.startswith("error:")]
    assert [c.value for c in at.caption].count("the call failed; what the agent was shown:") == 1
    attempts = at.dataframe[0].value
    assert attempts["id"].map(type).eq(str).all() and len(attempts["id"].iloc[0]) == 36, attempts


def test_trajectory_page_shows_the_learners_logprobs_beside_the_rollouts(app, seeded):
    """π_old per action token, stored by the learner step; the same weights generated and trained: they agree."""
    at = app("trajectory", id=seeded["xss"])
    page = _html(at)
    assert "π_old" in page and "|Δ|" in page
    assert any("agree on every action token" in m.value for m in at.success)
    at.radio[0].set_value("|μ − π_old|").run()
    assert "hsl(0, 85%" in _html(at)  # coloured by the gap now


def test_a_diverging_token_is_marked_where_it_diverges(app, seeded):
    """One stored π_old value moved by 1 nat: the page names that token and outlines it."""
    engine = sa.create_engine(seeded["url"])
    with engine.begin() as conn:
        trajectory = conn.execute(
            sa.text("SELECT trajectory_id FROM learner_logprob WHERE run_id = :r AND trajectory_id <> :x AND cardinality(logprobs) > 3 LIMIT 1"),
            {"r": seeded["run_id"], "x": seeded["xss"]},
        ).scalar_one()
        conn.execute(sa.text("UPDATE learner_logprob SET logprobs[3] = logprobs[3] - 1 WHERE trajectory_id = :t"), {"t": trajectory})
    try:
        at = app("trajectory", id=str(trajectory))
        segments = sa.create_engine(seeded["url"]).connect().execute(
            sa.text("SELECT seq, action_loss_mask FROM segment WHERE trajectory_id = :t ORDER BY seq"), {"t": trajectory}
        ).all()
        actions = [(seq, k) for seq, mask in segments for k, m in enumerate(mask) if m]
        seq, k = actions[2]  # the third action token (arrays are 1-based)
        assert f"segment {seq}, generated token {k}" in at.error[0].value
        assert _html(at).count("tok act first-gap") == 1
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE learner_logprob SET logprobs[3] = logprobs[3] + 1 WHERE trajectory_id = :t"), {"t": trajectory})
        engine.dispose()


def test_a_stored_token_id_the_tokenizer_would_not_give_is_marked(app, seeded, tiny_dirs):
    """The token-exactness view: decoding a segment's ids and tokenising the text again. The tiny policy's
    samples are often not the tokenizer's own segmentation (where, the page says); a prompt id replaced by
    one that decodes to text the tokenizer encodes otherwise is named by its position."""
    from transformers import AutoTokenizer

    from loopline.ui.data import first_retokenisation_difference

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["v0"])
    engine = sa.create_engine(seeded["url"])
    with engine.connect() as conn:
        trajectory, prompt, generated = conn.execute(
            sa.text("SELECT s.trajectory_id, s.prompt_ids, s.generated_ids FROM segment s JOIN trajectory t ON t.id = s.trajectory_id "
                    "WHERE t.run_id = :r AND s.seq = 0 AND NOT EXISTS (SELECT 1 FROM segment x WHERE x.trajectory_id = s.trajectory_id AND x.seq > 0) "
                    "ORDER BY s.trajectory_id LIMIT 1"),
            {"r": seeded["run_id"]},
        ).one()
    natural = first_retokenisation_difference(prompt + generated, tokenizer)
    assert natural is None or natural >= len(prompt)  # the chat template's prompt round-trips
    k = 5
    corrupt = next(t for t in range(len(tokenizer)) if first_retokenisation_difference(prompt[:k] + [t] + prompt[k + 1 :] + generated, tokenizer) == k)
    page = app("trajectory", id=str(trajectory))
    if natural is None:
        assert any("token-exact" in c.value for c in page.caption)
    else:
        assert any(f"re-tokenisation differs at generated token {natural - len(prompt)}" in w.value for w in page.warning)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE segment SET prompt_ids[:i] = :c WHERE trajectory_id = :t AND seq = 0"), {"i": k + 1, "c": corrupt, "t": trajectory})
    try:
        at = app("trajectory", id=str(trajectory))
        assert any(f"re-tokenisation differs at prompt token {k} (id {corrupt})" in w.value for w in at.warning)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE segment SET prompt_ids[:i] = :c WHERE trajectory_id = :t AND seq = 0"), {"i": k + 1, "c": prompt[k], "t": trajectory})
        engine.dispose()


def test_group_page_shows_samples_with_advantages(app, seeded):
    at = app("group", id=seeded["xss_group"])
    table = at.dataframe[0].value
    assert len(table) == 4 and "advantage" in table
    assert seeded["xss"] in set(table["id"])  # the ids as text (a uuid.UUID is not its text)
    assert abs(table["advantage"].sum()) < 1e-6  # GRPO advantages of a group are centred


def test_environments_page_shows_spec_and_diff(app, seeded, tmp_path):
    import yaml

    from loopline.store.db import make_engine, session

    spec = yaml.safe_load((ROOT / "examples" / "arithmetic_env.yaml").read_text())
    name = f"diffed-{tmp_path.name[-8:]}".replace("_", "-")
    engine = make_engine(seeded["url"])
    with session(engine) as s:
        for budget in (3, 5):  # two versions of one env: max_turns changed
            (tmp_path / "env.yaml").write_text(yaml.safe_dump({**spec, "name": name, "budgets": {**spec["budgets"], "max_turns": budget}}))
            registry.add(s, tmp_path / "env.yaml")
    engine.dispose()
    at = app("environments")
    assert "arithmetic" in at.dataframe[0].value["name"].tolist()
    assert "sandbox:" in at.code[0].value
    at.selectbox[0].set_value(f"{name}@2").run()  # the spec shown: by default diffed against the version before it
    assert "-  max_turns: 3" in at.code[1].value and "+  max_turns: 5" in at.code[1].value, at.code[1].value
    at.selectbox(key=f"diff-a-{name}@2").set_value(f"{name}@2").run()
    assert at.code[1].value == "(identical)"


def test_the_inspector_cannot_write(seeded):
    from loopline.ui.data import LedgerView

    with LedgerView(seeded["url"]).connect() as conn, pytest.raises(sa.exc.InternalError, match="read-only transaction"):
        conn.execute(sa.text("DELETE FROM consumption"))



@pytest.mark.slow
def test_browser_opens_a_run_clicks_into_a_trajectory_and_sees_masked_tokens(seeded, other_run, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: apt-get install chromium")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    port = free_port()
    env = {**os.environ, "LOOPLINE_DATABASE_URL": seeded["url"]}
    server = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "inspect", "--port", str(port)], env=env, cwd=ROOT,
        stdout=(tmp_path / "streamlit.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", server, tmp_path / "streamlit.log", timeout_s=60)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/?page=runs&run={seeded['run']}")
            page.get_by_text("Optimisation, per learner step").wait_for(timeout=30_000)
            assert page.get_by_text("Deploy", exact=True).count() == 0  # a viewer's toolbar: nothing to deploy
            # two runs chosen as a user chooses them (typed into the multiselect): their curves drawn, one chart each
            charts = page.locator(".vega-embed").count()
            for run in (seeded["run"], other_run.name):
                page.locator('[data-testid="stMultiSelect"] input').click()
                page.keyboard.type(run)
                page.get_by_role("option", name=run, exact=True).click()
                page.keyboard.press("Escape")
            page.get_by_text("reward_mean per learner step, by run").wait_for(timeout=30_000)
            page.get_by_text("Held-out success vs version, by run").wait_for(timeout=30_000)
            deadline = time.monotonic() + 30
            while page.locator(".vega-embed").count() < charts + 2:
                assert time.monotonic() < deadline, page.locator(".vega-embed").count()
                page.wait_for_timeout(200)
            chosen = page.locator('[data-testid="stMultiSelect"]').inner_text()
            assert f"{seeded['run']}\n" in chosen + "\n" and other_run.name in chosen, chosen  # the two names as the user reads them
            page.get_by_role("button", name="Open its trajectories").click()
            page.get_by_text(re.compile(r"^\d+ of \d+ trajectories; select a row")).wait_for(timeout=30_000)
            table = page.locator('[data-testid="stDataFrame"]').first
            table.locator("canvas").first.wait_for(timeout=30_000)
            deadline = time.monotonic() + 30
            while (box := table.bounding_box())["height"] < 100:  # drawn with its rows, at its final place
                assert time.monotonic() < deadline, box
                page.wait_for_timeout(200)
            page.wait_for_timeout(500)
            box = table.bounding_box()
            page.mouse.click(box["x"] + 14, box["y"] + 35 + 17)  # the first row's selection box (rows and header are 35 px)
            page.get_by_text(re.compile(r"^Trajectory [0-9a-f-]{36}$")).wait_for(timeout=30_000)  # the row opened its trajectory
            page.goto(f"http://127.0.0.1:{port}/?page=trajectory&id={seeded['xss']}")
            page.wait_for_selector("span.tok.act", timeout=30_000)
            page.get_by_text("Attempts at this slot").wait_for(timeout=30_000)
            page.wait_for_load_state("networkidle")
            assert page.locator("span.tok.act").count() > 0 and page.locator("span.tok.ctx").count() > 0
            assert "π_old" in page.locator("span.tok.act[title]").first.get_attribute("title")  # the learner's recompute beside μ
            colours = "() => Array.from(document.querySelectorAll('span.tok.act')).map(e => getComputedStyle(e).backgroundColor).join()"
            by_probability = page.evaluate(colours)
            page.get_by_text("|μ − π_old|", exact=True).click()  # colour by the gap: near white where they agree
            page.wait_for_function(f"() => ({colours})() !== {by_probability!r}", timeout=30_000)
            page.get_by_text(re.compile("token-exact|re-tokenisation differs")).first.wait_for(timeout=30_000)  # the token-exactness check
            assert page.evaluate("() => document.querySelectorAll('script').length") == page.evaluate(
                "() => Array.from(document.scripts).filter(s => s.src).length + Array.from(document.scripts).filter(s => !s.src && !s.textContent.includes('owned')).length"
            )  # no script tag from the trajectory made it into the page
            out = Path(os.environ.get("LOOPLINE_TEST_OUTPUT", ROOT / "test-output"))
            out.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out / "inspector-trajectory.png"), full_page=True)

            # a run that trains: its page redraws itself as steps land (the user does not reload)
            from loopline import holder

            writer = sa.create_engine(seeded["url"])
            with new_session(writer) as s:
                live = ledger.create_run(s, f"{seeded['run']}-live", {"test": "live"}, "file:///w")
                ledger.start_run(s, live.id, holder.this_process())
                for step in (1, 2):
                    s.execute(sa.text("INSERT INTO metric (run_id, step, name, value) VALUES (:r, :s, 'reward_mean', 0.5)"), {"r": live.id, "s": step})
                s.commit()
            page.goto(f"http://127.0.0.1:{port}/?page=runs&run={live.name}")
            page.get_by_text(f"{live.name}: running · learner step 2").wait_for(timeout=30_000)
            with new_session(writer) as s:
                s.execute(sa.text("INSERT INTO metric (run_id, step, name, value) VALUES (:r, 3, 'reward_mean', 0.7)"), {"r": live.id})
                ledger.heartbeat(s, live.id, holder.this_process())
                s.commit()
            page.get_by_text(f"{live.name}: running · learner step 3").wait_for(timeout=30_000)
            writer.dispose()
            browser.close()
    finally:
        os.killpg(server.pid, 9)
