"""Issue 29: a run a user can manage. Ctrl-C, SIGTERM, `loopline cancel` and SIGKILL each leave the run in a
status that says what happened (never `running` without a live process); it resumes, finishes, extends
to more steps, and is deleted; a config this machine cannot run is refused before the run exists."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from loopline.store.uris import path_on_publisher

from tests.integration.test_chaos import ROOT, _checked_run, _rows, _small_run


def _loopline(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loopline.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _start(env: dict, *args: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "train", *args], env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _until_version(db, name: str, version: int, proc: subprocess.Popen, log, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        found = _rows(db, "SELECT max(p.version) FROM policy_version p JOIN run r ON r.id = p.run_id WHERE r.name = :n", n=name)
        if found and found[0][0] is not None and found[0][0] >= version:
            return
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"v{version} was not committed in {timeout_s} s\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def _ended(proc: subprocess.Popen, log, within_s: float = 60) -> int:
    try:
        return proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the run's process did not stop within {within_s} s\n{log.read_text()[-4000:]}")


def _version(db, name: str) -> int:
    return _rows(db, "SELECT max(p.version) FROM policy_version p JOIN run r ON r.id = p.run_id WHERE r.name = :n", n=name)[0][0]


def _status(db, name: str) -> tuple[str, str | None]:
    return tuple(_rows(db, "SELECT status, status_reason FROM run WHERE name = :n", n=name)[0])


@pytest.mark.slow
@pytest.mark.timeout(15 * 60)  # (CI's other tests load the machine: measured up to 300 s, the default limit)
def test_interrupt_terminate_cancel_kill_resume_extend_and_delete_a_run(tiny_dirs, database_url, db, tmp_path):
    name = f"life-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=3, backend="torch", every=10)
    data = yaml.safe_load(config.read_text())
    data["steps"] = 1000  # more than it gets to before the kill below; it is then finished at fewer steps, and extended
    config.write_text(yaml.safe_dump(data))

    # Ctrl-C after v1: the process leaves at once, the run says it was interrupted and how to go on
    log = tmp_path / "sigint.log"
    proc = _start(env, str(config), log=log)
    _until_version(db, name, 1, proc, log)
    proc.send_signal(signal.SIGINT)
    assert _ended(proc, log) != 0
    status, reason = _status(db, name)
    assert status == "interrupted" and reason.startswith("interrupted (Ctrl-C)"), log.read_text()[-3000:]

    # SIGTERM (docker stop, systemd) after v2
    log = tmp_path / "sigterm.log"
    proc = _start(env, "--resume", name, log=log)
    _until_version(db, name, _version(db, name) + 1, proc, log)  # (a version this process made: it drives the run)
    proc.send_signal(signal.SIGTERM)
    assert _ended(proc, log) != 0
    assert _status(db, name) == ("interrupted", "terminated (SIGTERM); resume with loopline train --resume RUN"), log.read_text()[-3000:]

    # `loopline cancel` from another process after v3: the trainer stops and the run is cancelled
    log = tmp_path / "cancel.log"
    proc = _start(env, "--resume", name, log=log)
    _until_version(db, name, _version(db, name) + 1, proc, log)
    cancelled = _loopline(env, "cancel", name)
    assert cancelled.returncode == 0 and f"run {name}: cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    assert _ended(proc, log) != 0
    assert _status(db, name) == ("cancelled", "cancelled (loopline cancel)")

    # SIGKILL after the next version: the process cannot write, so `loopline runs` tells it is stale (its pid is gone)
    log = tmp_path / "sigkill.log"
    proc = _start(env, "--resume", name, log=log)
    _until_version(db, name, _version(db, name) + 1, proc, log)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _status(db, name)[0] == "running"
    listed = _loopline(env, "runs")
    assert f"{name}: stale: its process" in listed.stdout.replace("\n", " "), listed.stdout

    # resumed, it finishes (at one step more than it has); extended, it trains on one more; nothing consumed twice
    last = _version(db, name)
    for steps in (last + 1, last + 2):
        done = _loopline(env, "train", "--resume", name, "--steps", str(steps), timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert _status(db, name) == ("completed", None)
    run_id = _checked_run(db, name)
    assert [v for (v,) in _rows(db, "SELECT version FROM policy_version WHERE run_id = :r ORDER BY 1", r=run_id)] == list(range(last + 3))
    trained = (last + 2) * 2 * 4
    assert _rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM consumption WHERE run_id = :r", r=run_id)[0] == (trained, trained)
    shorter = _loopline(env, "train", "--resume", name, "--steps", "1")
    assert shorter.returncode == 1 and f"has trained {last + 2} steps already" in shorter.stdout + shorter.stderr
    finished = _loopline(env, "cancel", name)
    assert finished.returncode == 1 and "completed: nothing to cancel" in finished.stdout + finished.stderr

    # deleted: its ledger rows and its files
    workdir = tmp_path / "home" / "runs" / name
    assert workdir.is_dir()
    deleted = _loopline(env, "delete", name, "--yes")
    assert deleted.returncode == 0 and f"deleted run {name}" in deleted.stdout, deleted.stdout + deleted.stderr
    assert _rows(db, "SELECT count(*) FROM run WHERE name = :n", n=name)[0][0] == 0
    assert _rows(db, "SELECT count(*) FROM trajectory WHERE run_id = :r", r=run_id)[0][0] == 0
    assert not workdir.exists()


def test_a_config_this_environment_or_machine_cannot_run_is_refused_before_the_run_exists(tiny_dirs, database_url, db, tmp_path):
    name = f"refused-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=3, backend="torch", every=10)
    data = yaml.safe_load(config.read_text())
    for change, said in (
        ({"rollout": {**data["rollout"], "groups_per_step": 100000}}, "rollout.groups_per_step: 100000 is more than the"),
        ({"learner": {**data["learner"], "dtype": "bf16", "backend": "deepspeed"}}, "learner.dtype: bf16 needs a GPU with bf16"),
        ({"learner": {**data["learner"], "dtype": "fp16", "backend": "deepspeed"}}, "learner.dtype: fp16 needs a CUDA GPU"),
        ({"learner": {**data["learner"], "dtype": "bf16"}}, "learner.dtype: not a setting here; it is one of learner (backend: deepspeed)"),
        # (each of these left a `failed` run behind, the first with a 264-line traceback)
        ({"learner": {**data["learner"], "lora": {"rank": 4, "target_modules": ["nope_proj"]}}}, "Target modules {'nope_proj'} not found"),
        ({"engine": {"kind": "sglang", "servers": ["http://127.0.0.1:9"]}}, "the SGLang server http://127.0.0.1:9 does not answer"),
    ):
        config.write_text(yaml.safe_dump({**data, **change}))
        out = _loopline(env, "train", str(config))
        lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
        assert out.returncode == 1 and said in lines[-1], out.stdout + out.stderr
    assert _rows(db, "SELECT count(*) FROM run WHERE name = :n", n=name)[0][0] == 0


@pytest.mark.slow
@pytest.mark.timeout(15 * 60)  # (CI's other tests load the machine: measured up to 300 s, the default limit)
def test_a_trainer_frozen_while_another_took_the_run_over_commits_nothing(tiny_dirs, database_url, db, tmp_path):
    """Issue 31: two learners on one run. A second trainer is refused while the first is alive; once the first
    has been frozen past the lease it takes over; the first, woken, is refused at its next commit and exits
    with one line. The ledger is exact and every exported version's files are the ones its commit recorded."""
    from loopline.trainer.checkpoint import weights_sha256

    name = f"fence-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=3, backend="torch", every=1)
    data = yaml.safe_load(config.read_text())
    data["steps"] = 1000
    config.write_text(yaml.safe_dump(data))
    first_log = tmp_path / "first.log"
    first = _start(env, str(config), log=first_log)
    try:
        _until_version(db, name, 1, first, first_log)
        db.execute(sa.text("UPDATE run SET plan = '{\"mark\": 1}' WHERE name = :n"), {"n": name})
        db.commit()
        refused = _loopline(env, "train", "--resume", name)
        assert refused.returncode == 1 and f"run {name} is being trained by" in refused.stdout + refused.stderr, refused.stderr[-2000:]
        assert _rows(db, "SELECT plan FROM run WHERE name = :n", n=name)[0][0] == {"mark": 1}  # (the refused one wrote nothing)

        os.kill(first.pid, signal.SIGSTOP)  # frozen (a stalled VM, a debugger): its heartbeat stops
        time.sleep(17)  # past the lease (3 s) and three heartbeats (15 s): shown stale
        last = _version(db, name)
        second = _loopline(env, "train", "--resume", name, "--steps", str(last + 3), timeout=600)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        os.kill(first.pid, signal.SIGCONT)
        code = _ended(first, first_log, within_s=120)
        assert code != 0 and f"error: run {name}: this process" in first_log.read_text() and "no longer drives it" in first_log.read_text(), first_log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    run_id = _checked_run(db, name)
    # what the first wrote for the step it could not commit is gone with it (was kept: gigabytes with a real model)
    from loopline.store.ledger import named_files

    named = {Path(path_on_publisher(uri)).name for uri in named_files(db, run_id)}
    db.rollback()
    left = sorted(str(p) for p in (tmp_path / "home" / "runs" / name).glob(f"*/*.{first.pid}") if p.name not in named)
    assert left == [], left
    rows = _rows(db, "SELECT version, weights_uri, sha256 FROM policy_version WHERE run_id = :r ORDER BY 1", r=run_id)
    assert [v for v, _, _ in rows] == list(range(last + 4))
    exported = [(v, uri, sha) for v, uri, sha in rows if uri is not None and v > 0]
    assert exported and all(weights_sha256(path_on_publisher(uri)) == sha for _, uri, sha in exported), exported
    assert _status(db, name) == ("completed", None)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="puts the run's directory on a small tmpfs (needs root)")
def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_run_resumes_once_there_is_room(tiny_dirs, database_url, db, tmp_path):
    """Issue 31: the run's disk fills up; the step that cannot write its checkpoint commits nothing and the
    process exits with one line naming the directory and the size; freed, the run resumes exactly."""
    from loopline.trainer.checkpoint import weights_sha256

    name = f"disk-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=3, backend="torch", every=10)
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "steps": 2, "learner": {**data["learner"], "checkpoint_every": 1}}))
    workdir = tmp_path / "home" / "runs" / name
    workdir.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(workdir)], check=True)
    try:
        assert (done := _loopline(env, "train", str(config))).returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        room = shutil.disk_usage(workdir).used + 2**20  # 1 MiB more than the run holds: less than a checkpoint
        subprocess.run(["mount", "-o", f"remount,size={room}", str(workdir)], check=True)
        full = _loopline(env, "train", "--resume", name, "--steps", "4")
        lines = [line for line in (full.stdout + full.stderr).splitlines() if line.strip()]
        assert full.returncode == 1, full.stdout[-3000:] + full.stderr[-3000:]
        assert lines[-1].startswith(f"error: no space left on the disk of {workdir / 'checkpoints'} for step-000003: it needs about "), lines[-5:]
        assert "Traceback" not in full.stdout + full.stderr and "enforce fail" not in full.stdout + full.stderr
        assert _version(db, name) == 2 and _status(db, name)[0] == "failed"
        assert not [p for p in workdir.rglob("*") if "000003" in p.name or ".tmp-" in p.name]  # nothing half-written kept
        subprocess.run(["mount", "-o", "remount,size=256m", str(workdir)], check=True)
        assert (resumed := _loopline(env, "train", "--resume", name)).returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        run_id = _checked_run(db, name)
        rows = _rows(db, "SELECT version, weights_uri, sha256 FROM policy_version WHERE run_id = :r ORDER BY 1", r=run_id)
        assert [v for v, _, _ in rows] == [0, 1, 2, 3, 4]
        on_disk = [(path_on_publisher(uri), sha) for v, uri, sha in rows if uri is not None and v > 0 and os.path.isdir(path_on_publisher(uri))]  # (older ones pruned)
        assert path_on_publisher(rows[-1][1]) in dict(on_disk) and all(weights_sha256(uri) == sha for uri, sha in on_disk), on_disk
        assert _status(db, name) == ("completed", None)
    finally:
        subprocess.run(["umount", "--lazy", str(workdir)], check=False)
