"""The trajectory inspector: why did this trajectory train the way it did?

Run with `loopline inspect [--run RUN]`. Pages are chosen by the `page` query parameter (runs,
trajectories, trajectory, group, environments), so every view has a link. Read-only: see data.py.
Model and tool output is untrusted: every piece of it is HTML-escaped before it is shown.
"""

from __future__ import annotations

import html
import json
import math
import os
import subprocess
import sys
import uuid
from functools import lru_cache

import pandas as pd
import streamlit as st
import yaml

from loopline.store.check import LOGPROB_GAP_TOLERANCE
from loopline.ui.data import (
    LedgerView,
    Token,
    displayable,
    overlaid,
    first_divergence,
    chain_of,
    first_retokenisation_difference,
    segment_tokens,
    with_learner_logprobs,
)

PAGES = {"runs": "Runs", "trajectories": "Trajectories", "trajectory": "Trajectory", "group": "Group", "environments": "Environments"}


@st.cache_resource
def ledger() -> LedgerView:
    return LedgerView(os.environ.get("LOOPLINE_DATABASE_URL") or None)


@lru_cache(maxsize=8)
def run_tokenizer(weights_dir: str | None):
    """The run's tokenizer, or None when it is not on this machine (or cannot be loaded)."""
    if weights_dir:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(weights_dir)
        except Exception:  # a tokenizer we cannot load is shown as ids, never an error page
            pass
    return None


def decoder(weights_dir: str | None):
    """id -> text with the run's tokenizer; ids stay ids when it is not on this machine."""
    tokenizer = run_tokenizer(weights_dir)
    if tokenizer is None:
        return lambda i: f"⟨{i}⟩"
    return lambda i: tokenizer.decode([i])


def go(page: str, **params: str) -> None:
    st.query_params.clear()
    st.query_params.update({"page": page, **params})
    st.rerun()


def _uuid(value: str | None) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


# --------------------------------------------------------------------------- token rendering

STYLE = """
<style>
.tokens { font-family: ui-monospace, monospace; font-size: 0.85rem; line-height: 1.9; white-space: pre-wrap; word-break: break-all; }
.tok { padding: 1px 0; border-radius: 3px; }
.ctx { color: #555; background: #eef0f3; }
.act { color: #000; outline: 1px solid #2b6cb0; }
.first-gap { outline: 2px solid #c53030; }
.legend span { margin-right: 1.2em; }
</style>
"""


def heat(logprob: float) -> str:
    """Probability as colour: red (unlikely) to green (certain)."""
    p = max(0.0, min(1.0, math.exp(logprob)))
    return f"hsl({int(120 * p)}, 75%, 78%)"


def gap_heat(gap: float, tolerance: float) -> str:
    """|μ − π_old| as colour: white (agree) to red (at 10 x the tolerance and beyond)."""
    level = max(0.0, min(1.0, gap / (10 * tolerance)))
    return f"hsl(0, 85%, {int(97 - 30 * level)}%)"


def render_tokens(tokens: list[Token], by_gap: bool = False, tolerance: float = LOGPROB_GAP_TOLERANCE, first: int | None = None) -> str:
    """`by_gap`: colour action tokens by |μ − π_old| instead of μ's probability; `first`: the index of the
    first token past the tolerance, outlined."""
    parts = []
    for k, t in enumerate(tokens):
        text = html.escape(t.text).replace("\n", "⏎\n")
        if t.action:
            learner = "" if t.learner_logprob is None else f" · π_old {t.learner_logprob:.4f} · |Δ| {t.gap:.2e}"
            title = html.escape(f"id {t.id} · μ {t.logprob:.4f} · p {math.exp(t.logprob):.3f}{learner} · v{t.version} · mask 1", quote=True)
            colour = gap_heat(t.gap, tolerance) if by_gap and t.gap is not None else heat(t.logprob)
            marked = " first-gap" if k == first else ""
            parts.append(f'<span class="tok act{marked}" style="background:{colour}" title="{title}">{text}</span>')
        else:
            title = html.escape(f"id {t.id} · context · mask 0", quote=True)
            parts.append(f'<span class="tok ctx" title="{title}">{text}</span>')
    return f'<div class="tokens">{"".join(parts)}</div>'


# --------------------------------------------------------------------------- pages


# The learner's step metrics charted on the Runs page (those a run recorded), with what each one says.
OPTIMISATION = {
    "loss": "loss", "grad_norm": "gradient norm (before clipping)", "clip_fraction": "fraction of tokens clipped",
    "kl_ref": "KL to the reference policy", "entropy": "policy entropy (mean over trained tokens)",
}
# ... and the batches it trained on (verl's names)
BATCHES = {
    "response_length/mean": "generated tokens per trajectory (mean)", "response_length/max": "generated tokens per trajectory (max)",
    "perf/tokens_per_s": "learner throughput (tokens per second)",
}
# ... and how its episodes went
EPISODES = {
    "rollout/truncated_frac": "episodes cut by a budget (fraction)", "tool/calls_per_episode": "tool calls per episode",
    "tool/error_frac": "tool calls that failed (fraction)", "rollout/infra_failed_frac": "attempts failed outside the policy (fraction)",
}


COMPARED = ("reward_mean", "loss", "entropy", "kl_ref", "grad_norm", "response_length/mean", "rollout/truncated_frac")
EVAL_AXES = {"version": "policy_version", "wall-clock (s)": "seconds", "trained tokens": "tokens_trained"}
REFRESH_S = 5.0  # how often the charts of a run that trains are redrawn


def compare_runs(db: LedgerView, names: list[str]) -> None:
    """Several runs' curves on one chart each (the question users ask of runs: which setting did better)."""
    chosen = st.multiselect("Compare runs", names, key="compare", placeholder="choose runs to overlay their curves")
    if not chosen:
        return
    ids = {name: db.run_id(name) for name in chosen}
    metrics, evals = {n: db.metrics(i) for n, i in ids.items()}, {n: db.evals(i) for n, i in ids.items()}
    recorded = sorted({m for frame in metrics.values() for m in frame.columns if m != "step"})
    left, middle, right = st.columns(3)
    metric = left.selectbox("Training metric", [m for m in COMPARED if m in recorded] + [m for m in recorded if m not in COMPARED], key="compare-metric")
    axis = middle.radio("Held-out success against", list(EVAL_AXES), horizontal=True, key="compare-axis")
    smoothing = right.slider("Smoothing", 0.0, 0.95, 0.0, 0.05, key="compare-smoothing")
    summary = pd.DataFrame([
        {
            "run": n, "steps": int(metrics[n]["step"].max()) if not metrics[n].empty else 0,
            "last training reward": float(metrics[n]["reward_mean"].iloc[-1]) if "reward_mean" in metrics[n] else None,
            "best held-out success": float(evals[n]["success_rate"].max()) if not evals[n].empty else None,
            "at version": int(evals[n].loc[evals[n]["success_rate"].idxmax(), "policy_version"]) if not evals[n].empty else None,
        }
        for n in chosen
    ])
    st.dataframe(summary, hide_index=True)
    left, right = st.columns(2)
    with left:
        st.subheader(f"{metric} per learner step, by run")
        if metric:
            st.line_chart(overlaid(metrics, "step", metric, smoothing), x="step", y=metric, color="run")
    with right:
        st.subheader(f"Held-out success vs {axis}, by run")
        st.line_chart(overlaid(evals, EVAL_AXES[axis], "success_rate"), x=EVAL_AXES[axis], y="success_rate", color="run")
    st.divider()


def page_runs(db: LedgerView) -> None:
    st.header("Runs")
    runs = db.runs()
    if runs.empty:
        st.info("No runs in this ledger yet. Start one with `loopline train examples/arithmetic_quickstart.yaml`.")
        return
    st.dataframe(runs.drop(columns=["id"]), hide_index=True)
    names = list(runs["name"])
    compare_runs(db, names)
    chosen = st.query_params.get("run")
    name = st.selectbox("Run", names, index=names.index(chosen) if chosen in names else 0)
    run_id = db.run_id(name)
    if st.button("Open its trajectories"):
        go("trajectories", run=name)
    training = runs.loc[runs["name"] == name, "status"].iloc[0] == "running"
    # a run that trains is redrawn in place (the fragment alone: the widgets above keep their state)
    st.fragment(run_every=REFRESH_S if training else None)(run_charts)(db, name, run_id)
    metrics = db.metrics(run_id)
    if "step" in metrics and not metrics.empty:
        replay_step(name, int(metrics["step"].max()))
    with st.expander("The run's config (as the ledger stored it)"):
        st.code(yaml.safe_dump(db.run_config(run_id), sort_keys=False), language="yaml")


def run_charts(db: LedgerView, name: str, run_id: uuid.UUID) -> None:
    """One run's curves, read afresh each time they are drawn."""
    metrics, evals = db.metrics(run_id), db.evals(run_id)
    runs = db.runs()
    status = runs.loc[runs["name"] == name, "status"].iloc[0]
    steps = int(metrics["step"].max()) if "step" in metrics and not metrics.empty else 0
    st.caption(f"{name}: {status} · learner step {steps}" + (f" · redrawn every {REFRESH_S:g} s while it trains" if status == "running" else ""))
    left, right = st.columns(2)
    with left:
        st.subheader("Training reward")
        if "reward_mean" in metrics:
            st.line_chart(metrics, x="step", y="reward_mean")
        st.subheader("Held-out success vs wall-clock (s)")
        if not evals.empty:
            st.line_chart(evals, x="seconds", y="success_rate")
        st.subheader("Rollout throughput (trajectories per minute)")
        st.bar_chart(db.throughput(run_id), x="minute", y="trajectories")
        st.subheader("Seconds per learner step, by part")
        timings = db.step_timings(run_id)
        if not timings.empty:
            st.bar_chart(timings, x="step", y="seconds", color="part")
        st.subheader("Degenerate-group rate")
        if {"degenerate_groups", "groups"} <= set(metrics):
            st.line_chart(metrics.assign(rate=metrics["degenerate_groups"] / metrics["groups"]), x="step", y="rate")
    with right:
        st.subheader("Held-out success per version")
        if not evals.empty:
            st.dataframe(evals, hide_index=True)
        st.subheader("Held-out success vs trained tokens")
        if not evals.empty:
            st.line_chart(evals, x="tokens_trained", y="success_rate")
        st.subheader("Version lag of trained samples")
        st.bar_chart(db.version_lags(run_id), x="version_lag", y="samples")
        st.subheader("Failure classes per step")
        failures = db.failure_classes(run_id)
        if not failures.empty:
            st.bar_chart(failures, x="step", y="attempts", color="class")
        st.subheader("Rollout vs learner logprob gap (mean |Δ|)")
        if "logprob_abs_diff" in metrics:
            st.line_chart(metrics, x="step", y="logprob_abs_diff")
        servers = db.engine_servers(run_id)
        if not servers.empty:
            st.subheader("Rollout engines and the version each serves (SGLang servers by URL; a process's own CPU engine as in-process)")
            st.dataframe(servers, hide_index=True)
        st.subheader("Memory: planned vs measured")
        memory = db.run_plan(run_id)
        if memory is None:
            st.caption("no plan stored (the run started before loopline planned memory)")
        else:
            rows = [("learner", part, b) for part, b in memory["learner"].items()] + [("engine", part, b) for part, b in memory["engine"].items()]
            planned = sum(b for _, _, b in rows)
            st.dataframe(pd.DataFrame(rows, columns=["where", "part", "bytes"]).assign(GiB=lambda f: f["bytes"] / 2**30), hide_index=True)
            measured = memory["measured_peak"]
            st.caption(
                f"planned {planned / 2**30:.2f} GiB on {memory['hardware']} ({memory['verdict'].split(':')[0]}); measured peak RSS of the "
                f"training process {'-' if measured is None else f'{measured / 2**30:.2f} GiB'} (it also holds the runtime, the tokenizer and the CPU engine's batch)"
            )
        gaps = db.logprob_gaps(run_id)
        if not gaps.empty:
            st.subheader("|μ − π_old| per trajectory, by step (max over its tokens)")
            spread = gaps.groupby("step")["max_abs_diff"].describe(percentiles=[0.5, 0.95])[["50%", "95%", "max"]]
            st.line_chart(spread.reset_index().melt("step", var_name="quantile", value_name="max |Δ|"), x="step", y="max |Δ|", color="quantile")
            st.caption(f"worst trajectories (tolerance {LOGPROB_GAP_TOLERANCE:g} per token)")
            worst = gaps.nlargest(10, "max_abs_diff").assign(open=lambda f: "?page=trajectory&id=" + f["id"].astype(str))
            st.dataframe(
                displayable(worst), hide_index=True, column_config={"open": st.column_config.LinkColumn("open", display_text="open")},
            )

    st.subheader("Optimisation, per learner step")
    for charts in (OPTIMISATION, BATCHES, EPISODES):
        shown = [m for m in charts if m in metrics]
        for column, metric in zip(st.columns(max(len(shown), 1)), shown):
            with column:
                st.caption(charts[metric])
                st.line_chart(metrics, x="step", y=metric)


def replay_step(run: str, last_step: int) -> None:
    """`loopline replay`: a Prefect flow run (it shows in the Prefect UI too) that retrains one step from the
    ledger's records and compares the weights with the recorded version. It writes nothing to the ledger."""
    st.subheader("Replay a learner step")
    step = int(st.number_input("learner step", min_value=1, max_value=last_step, value=last_step, key="replay-step"))
    if not st.button(f"Replay step {step}", key="replay"):
        st.caption("retrains the step on exactly the batch it consumed and compares the sha256 with the recorded version")
        return
    with st.spinner(f"replaying {run} step {step} (newest checkpoint before it, then the recorded steps since)"):
        done = subprocess.run(
            [sys.executable, "-m", "loopline.cli", "replay", run, "--step", str(step)], capture_output=True, text=True, timeout=3600,
            env={**os.environ, "COLUMNS": "400"},  # the verdict on one line
        )
    # one line per step replayed (those on the way from the checkpoint are compared too)
    verdict = "\n\n".join(line.strip() for line in done.stdout.splitlines() if line.startswith(f"{run} step ") and ": sha256 " in line)
    if done.returncode == 0 and verdict:
        st.success(verdict)
    elif verdict:
        st.error(verdict)
    else:
        st.error(f"the replay failed (exit {done.returncode}):\n\n" + "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:]))


def page_trajectories(db: LedgerView) -> None:
    st.header("Trajectories")
    runs = db.runs()
    if runs.empty:
        st.info("No runs yet.")
        return
    names = list(runs["name"])
    chosen = st.query_params.get("run")
    name = st.selectbox("Run", names, index=names.index(chosen) if chosen in names else 0)
    limit = int(st.query_params.get("limit", 1000))  # ?limit=N shows more (or fewer) at once
    table = db.trajectories(db.run_id(name), limit)
    if table.empty:
        st.info("This run has no committed trajectories yet.")
        return
    total = int(runs.loc[runs["name"] == name, "trajectories"].iloc[0])
    if total > len(table):
        st.warning(f"showing the first {len(table):,} of {total:,} trajectories (oldest steps first); add ?limit={total} to the address for all")
    f1, f2, f3, f4 = st.columns(4)
    splits = f1.multiselect("Split", sorted(table["split"].unique()), default=sorted(table["split"].unique()))
    classes = f2.multiselect("Failure class", sorted(table["failure_class"].unique()), default=sorted(table["failure_class"].unique()))
    consumed = f3.selectbox("Consumed", ["any", "yes", "no"])
    low, high = float(table["reward"].min()), float(table["reward"].max())
    rewards = f4.slider("Reward", low, max(high, low + 1e-9), (low, max(high, low + 1e-9)))
    shown = table[table["split"].isin(splits) & table["failure_class"].isin(classes) & table["reward"].between(*rewards)]
    if consumed != "any":
        shown = shown[shown["consumed"] == (consumed == "yes")]
    st.caption(f"{len(shown)} of {len(table)} trajectories; select a row to open it")
    # a fresh key per visit: a selection kept in the session would reopen the same trajectory on return
    visit = st.session_state.setdefault("trajectory_table_visit", 0)
    picked = st.dataframe(
        shown.drop(columns=["group_id", "created_at"]).astype({"id": str}), hide_index=True,
        on_select="rerun", selection_mode="single-row", key=f"trajectory-table-{visit}",
    ).selection.rows
    if picked:
        st.session_state["trajectory_table_visit"] = visit + 1
        go("trajectory", id=str(shown.iloc[picked[0]]["id"]))


def page_trajectory(db: LedgerView) -> None:
    trajectory_id = _uuid(st.query_params.get("id"))
    t = db.trajectory(trajectory_id) if trajectory_id else None
    if t is None:
        st.header("Trajectory")
        st.warning("No such trajectory; open one from the Trajectories page.")
        return
    st.header(f"Trajectory {t['id']}")
    st.markdown(STYLE, unsafe_allow_html=True)
    c = st.columns(6)
    c[0].metric("Reward", f"{t['reward']:g}")
    c[1].metric("Outcome", t["failure_type"] or "passed")
    c[2].metric("Policy versions", f"{t['policy_version_min']}–{t['policy_version_max']}")
    c[3].metric("Consumed at step", "no" if t["learner_step"] is None else str(t["learner_step"]))
    c[4].metric("Version lag", "-" if t["version_lag"] is None else str(t["version_lag"]))
    c[5].metric("Split", t["split"])
    st.caption(f"run {t['run_name']} · task {t['task_id']} · {t['env_name']}@{t['env_version']} · step {t['step']}, group {t['group_index']}")
    if st.button("Open its group"):
        go("group", id=str(t["group_id"]))
    decode = decoder(db.initial_weights(t["run_id"]))
    tokenizer = run_tokenizer(db.initial_weights(t["run_id"]))
    st.markdown(
        '<div class="legend"><span class="tok ctx">context (mask 0)</span>'
        '<span class="tok act" style="background:hsl(120,75%,78%)">action, p≈1</span>'
        '<span class="tok act" style="background:hsl(0,75%,78%)">action, p≈0</span>'
        "<span>hover a token for id, logprob and version</span></div>",
        unsafe_allow_html=True,
    )
    segments = db.segments(t["id"])
    rendered = [segment_tokens(segment, decode) for segment in segments]
    generated_all = with_learner_logprobs([g for _, g in rendered], db.learner_logprobs(t["id"]))
    first = first_divergence(generated_all, LOGPROB_GAP_TOLERANCE)
    has_learner = any(tok.learner_logprob is not None for g in generated_all for tok in g)
    by_gap = has_learner and st.radio("Colour action tokens by", ["probability (μ)", "|μ − π_old|"], horizontal=True) == "|μ − π_old|"
    if not has_learner:
        st.caption("no learner logprobs: this trajectory was not trained (or was trained before loopline stored them)")
    elif first is None:
        st.success(f"inference and training agree on every action token (|μ − π_old| ≤ {LOGPROB_GAP_TOLERANCE:g})")
    else:
        st.error(f"first token with |μ − π_old| > {LOGPROB_GAP_TOLERANCE:g}: segment {segments[first[0]]['seq']}, generated token {first[1]} (outlined red)")
    for segment, (prompt, _), generated in zip(segments, rendered, generated_all):
        spans = ", ".join(f"v{s['version']} [{s['start']}:{s['end']})" for s in segment.get("version_spans") or []) or f"v{segment['policy_version']}"
        st.subheader(f"Segment {segment['seq']} · {len(generated)} generated tokens · {spans}")
        if segment.get("starts_chain"):
            st.info("this call did not extend the previous one's tokens (the agent rewrote its history, or called twice at once): "
                    "it starts a chain of its own, trained as a sequence of its own with the episode's advantage")
        st.caption(f"request {segment['request_id']} · logprobs: {segment['logprob_semantics']} · sampling {json.dumps(segment['sampling_config'])}")
        if tokenizer is not None and segment["chain_ids"] is not None:  # (once per chain, at its last call)
            ids = segment["chain_ids"]
            differs = first_retokenisation_difference(ids, tokenizer)
            if differs is None:
                st.caption(f"token-exact: decoding these {len(ids)} ids (this call's prompt and generation, which hold its chain's "
                           "calls) and tokenising the text again gives the same ids")
            else:
                at = next(s for s in chain_of(segments, segment) if differs < s["prompt_len"] + len(s["generated_ids"]))
                where = f"prompt token {differs}" if differs < at["prompt_len"] else f"generated token {differs - at['prompt_len']}"
                st.warning(
                    f"re-tokenisation differs at {where} (id {ids[differs] if differs < len(ids) else '-'})"
                    + (f" of segment {at['seq']}" if at is not segment else "")
                    + ": training on re-tokenised text would not train on what the engine generated"
                )
        title = (f"Prompt the model saw ({segment['prompt_len']} tokens)" if not segment["continues"] else
                 f"Prompt the model saw ({segment['prompt_len']} tokens: the {segment['continues']} of the call above, then these {len(prompt)})")
        with st.expander(title, expanded=segment["seq"] == 0):
            st.markdown(render_tokens(prompt), unsafe_allow_html=True)
            st.code(json.dumps(segment["prompt_ids"]), language=None)
        mark = first[1] if first is not None and segments[first[0]] is segment else None
        st.markdown(render_tokens(generated, by_gap, LOGPROB_GAP_TOLERANCE, mark), unsafe_allow_html=True)
        for event in segment.get("tool_events") or []:
            st.markdown(f"**tool** `{html.escape(str(event.get('tool')))}` · {event.get('seconds', 0):.3f} s")
            st.code(json.dumps(event.get("args"), ensure_ascii=False), language=None)  # st.code shows text, never markup
            if event.get("error"):  # (True, or an older ledger's message): the agent saw the output below all the same
                st.caption("the call failed; what the agent was shown:")
            st.code(str(event.get("output")), language=None)
    st.subheader("Verifier")
    st.json(dict(t["info"] or {}))
    st.json(dict(t["timings"] or {}))
    st.subheader("Attempts at this slot")
    st.dataframe(displayable(db.attempts(t["slot_id"])), hide_index=True)


def page_group(db: LedgerView) -> None:
    group_id = _uuid(st.query_params.get("id"))
    samples = db.group(group_id) if group_id else pd.DataFrame()
    if samples.empty:
        st.header("Group")
        st.warning("No such group; open one from a trajectory.")
        return
    first = db.trajectory(samples["id"].iloc[0])
    st.header(f"Group of task {first['task_id']}")
    trained = bool(samples["consumed"].all())
    if trained:
        degenerate = bool(samples["degenerate"].fillna(False).any())
        st.caption(
            "advantages as the learner used them (stored with each consumption): "
            + ("degenerate group, all rewards equal" if degenerate else
               f"group mean {samples['group_mean'].iloc[0]:.3f}, std {samples['group_std'].iloc[0]:.3f}")
        )
    else:
        st.caption("not trained yet: advantages exist once a learner step consumes the group")
    st.dataframe(displayable(samples), hide_index=True)
    decode = decoder(db.initial_weights(first["run_id"]))
    st.markdown(STYLE, unsafe_allow_html=True)
    columns = st.columns(min(len(samples), 4))
    for i, row in enumerate(samples.itertuples()):
        with columns[i % len(columns)]:
            advantage = f"advantage {row.advantage:+.3f}" if row.advantage is not None and row.advantage == row.advantage else "not trained yet"
            st.markdown(f"**sample {row.sample_index}** · reward {row.reward:g} · {advantage}")
            for segment in db.segments(row.id):
                st.markdown(render_tokens(segment_tokens(segment, decode)[1]), unsafe_allow_html=True)
            if st.button("Open", key=f"open-{row.id}"):
                go("trajectory", id=str(row.id))


def page_environments(db: LedgerView) -> None:
    from loopline.envregistry import registry
    from loopline.store import db as store_db

    st.header("Environments")
    envs = db.environments()
    if envs.empty:
        st.info("No environments registered; `envreg add env.yaml`.")
        return
    st.dataframe(envs, hide_index=True)
    refs = [f"{r.name}@{r.version}" for r in envs.itertuples()]
    ref = st.selectbox("Spec of", refs)
    with store_db.session(db.engine) as s:
        st.code(registry.show(registry.get(s, ref)), language="yaml")
        # by default the spec shown against the version of the same env before it (itself when it is the first)
        name, _, version = ref.rpartition("@")
        earlier = [r for r in refs if r.rpartition("@")[0] == name and int(r.rpartition("@")[2]) < int(version)]
        before = max(earlier, key=lambda r: int(r.rpartition("@")[2])) if earlier else ref
        left, right = st.columns(2)
        a = left.selectbox("Diff from", refs, index=refs.index(before), key=f"diff-a-{ref}")
        b = right.selectbox("to", refs, index=refs.index(ref), key=f"diff-b-{ref}")
        st.code(registry.diff(registry.get(s, a), registry.get(s, b)) or "(identical)", language="diff")


def main() -> None:
    st.set_page_config(page_title="loopline inspector", layout="wide")
    db = ledger()
    current = st.query_params.get("page", "runs")
    if current not in PAGES:
        current = "runs"
    keys = list(PAGES)
    picked = st.sidebar.radio("Page", keys, index=keys.index(current), format_func=PAGES.get)
    if picked != current:
        go(picked, **({"run": st.query_params["run"]} if "run" in st.query_params else {}))
    st.sidebar.caption("read-only view of the ledger")
    {"runs": page_runs, "trajectories": page_trajectories, "trajectory": page_trajectory, "group": page_group, "environments": page_environments}[current](db)


main()
