"""`engine: sglang` in the loop, against the model-backed SGLang stand-in (tests/fakes/sglang_protocol_server.py).

A real SGLang server decodes 1-3 tokens/s on this CPU (docs/sglang-cpu/README.md), so these tests run
`loopline train` against stand-in server processes that speak SGLang's HTTP API (validated with SGLang's
own schema classes) and generate with the real tiny model, reproducing the real server's observed
behaviour (exact-rid abort, seeds ignored without deterministic inference, "default" version, dying on a
bad weights file). `benchmarks/sglang_real.py` runs the same kind of run against a real server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from loopline.store.uris import path_on_publisher

from tests.integration.test_chaos import _checked_run, _kill_at_each_then_resume, _rows, _small_run, _train
from loopline.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = "tests.fakes.sglang_protocol_server"



class StandIns:
    """SGLang stand-in server processes serving `model` (what a user would start with sglang.launch_server)."""

    def __init__(self, model: Path, count: int, log_dir: Path):
        self.ports = [free_port() for _ in range(count)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", STAND_IN, "--model-path", str(model), "--port", str(port)],
                cwd=ROOT, stdout=(log_dir / f"server-{port}.log").open("w"), stderr=subprocess.STDOUT,
            )
            for port in self.ports
        ]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        deadline = time.monotonic() + 60
        for url, proc in zip(self.urls, self.procs):
            while True:
                assert proc.poll() is None, f"stand-in at {url} exited"
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"stand-in at {url} did not start"
                time.sleep(0.2)

    def versions(self) -> list[str]:
        return [httpx.get(f"{u}/model_info").json()["weight_version"] for u in self.urls]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def stand_ins(tiny_dirs, tmp_path):
    from tests.fakes.sglang_protocol_server import load_api_types

    if load_api_types() is None:
        pytest.fail("the SGLang tests need SGLang's schema classes: pip install --no-deps sglang==0.5.23 msgspec")
    servers = StandIns(tiny_dirs["v0"], 2, tmp_path)
    yield servers
    servers.stop()


def _sglang_run(tmp_path: Path, name: str, policy: Path, database_url: str, engine: dict, steps: int = 2):
    config, env = _small_run(tmp_path, name, policy, database_url, mode="sync", lease_seconds=3, backend="torch", every=steps)
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "steps": steps, "engine": engine}))
    return config, env


@pytest.mark.slow
def test_train_with_sglang_servers_syncs_every_replica_and_survives_sigkill(stand_ins, tiny_dirs, database_url, db, tmp_path):
    name = f"sglang-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _sglang_run(tmp_path, name, tiny_dirs["v0"], database_url, {"kind": "sglang", "servers": stand_ins.urls}, steps=3)
    # killed right after the replicas loaded v1 (before the ledger says it is published), then inside the
    # learner's commit of step 2; each resume finds the servers as they are and carries on
    _kill_at_each_then_resume(config, env, ("weight_sync", "learner_commit:2"), tmp_path)
    run_id = _checked_run(db, name)
    assert stand_ins.versions() == [f"3@{run_id.hex[:8]}"] * 2  # every replica serves the run's newest version
    # the ledger says so too: each process registered the servers it synced, the last one left them at v3
    registered = _rows(
        db, "SELECT url, served_version, released_at IS NOT NULL FROM engine_server WHERE run_id = :r AND served_version = 3 ORDER BY url", r=run_id,
    )
    assert registered == [(url, 3, True) for url in sorted(stand_ins.urls)]
    published = _rows(db, "SELECT version, sync_timings FROM policy_version WHERE run_id = :r AND version > 0 ORDER BY version", r=run_id)
    assert [v for v, _ in published] == [1, 2, 3]
    for version, timings in published[1:]:  # v1's sync was cut short by the kill: its servers already had it
        assert timings["replicas"] == 2 and timings["load_s"] > 0 and "check_s" in timings, (version, timings)
    consumed, distinct = _rows(
        db, "SELECT count(*), count(DISTINCT trajectory_id) FROM consumption WHERE run_id = :r", r=run_id
    )[0]
    assert consumed == distinct == 3 * 2 * 4
    # the learner's recompute agrees with the servers' logprobs on the tokens its own weights generated
    gaps = [v for (v,) in _rows(db, "SELECT value FROM metric WHERE run_id = :r AND name = 'logprob_abs_diff'", r=run_id)]
    assert gaps and max(gaps) < 1e-3, gaps

    # `loopline eval` goes through the same engine: the servers serve v3, so v2 cannot be evaluated on them
    refused = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "eval", name, "--version", "2"], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode == 1 and "serve v3, not v2" in refused.stderr, refused.stdout + refused.stderr


@pytest.mark.slow
def test_train_launching_sglang_replicas_leaves_none_behind(tiny_dirs, database_url, db, tmp_path):
    name = f"sglang-launch-{tmp_path.name[-12:]}".replace("_", "-")
    engine = {"kind": "sglang", "launch": {"replicas": 2, "module": STAND_IN, "startup_timeout_s": 60}}
    config, env = _sglang_run(tmp_path, name, tiny_dirs["v0"], database_url, engine, steps=2)
    leftovers: list[str] = []
    log = tmp_path / "killed.log"
    assert _train(config, env, "weight_sync", log, leftovers) == -signal.SIGKILL, log.read_text()[-4000:]
    assert leftovers == [], f"the killed trainer left {leftovers} running"  # its replicas died with it
    log = tmp_path / "final.log"
    assert _train(config, env, None, log) == 0, log.read_text()[-4000:]
    run_id = _rows(db, "SELECT id FROM run WHERE name = :n", n=name)[0][0]
    assert [v for (v,) in _rows(db, "SELECT version FROM policy_version WHERE run_id = :r ORDER BY version", r=run_id)] == [0, 1, 2]
    replica_logs = sorted((tmp_path / "home" / "runs" / name / "sglang").glob("sglang-*.log"))
    assert len(replica_logs) == 2 and all("starting replica" in p.read_text() for p in replica_logs)
    # the resumed trainer's two launched replicas, registered in the ledger at v2 and released at its end
    served = _rows(db, "SELECT served_version, released_at IS NOT NULL FROM engine_server WHERE run_id = :r AND served_version = 2", r=run_id)
    assert served == [(2, True), (2, True)]


def test_launched_replica_that_dies_is_restarted_on_the_last_good_version(tiny_dirs, tmp_path):
    """A real server dies on a bad weights file; loopline refuses such a file before any server sees it, and
    restarts a replica that died anyway (here: killed) on the newest version every replica had loaded."""
    from loopline.rollout.engines.base import EngineError, SamplingParams
    from loopline.rollout.engines.sglang_launch import LaunchedSGLang, LaunchPlan
    from loopline.rollout.weights.check import BadWeights

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_dirs["v1"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a partial write

    plan = LaunchPlan(replicas=2, module=STAND_IN, startup_timeout_s=60)
    engine = LaunchedSGLang(plan, tmp_path / "logs", str(tiny_dirs["v0"]), 0, str(tiny_dirs["v0"]))

    async def scenario():
        sampling = SamplingParams(max_new_tokens=4)
        await engine.update_weights(1, str(tiny_dirs["v1"]))
        with pytest.raises(BadWeights, match="partial or corrupt"):
            await engine.update_weights(2, str(bad))
        assert all(s.alive() for s in engine.servers) and engine.version() == 1  # untouched
        # without the check, the corrupt file kills the server, as on a real one
        engine.client.served_layout = None
        with pytest.raises(EngineError, match=r"replicas \[0\] died and were restarted on v1"):
            await engine.update_weights(2, str(bad))
        assert engine.servers[0].restarts == 1 and await engine.refresh_versions() == [1, 1]
        os.kill(engine.servers[1].process.pid, signal.SIGKILL)
        engine.servers[1].process.wait()
        with pytest.raises(EngineError):
            await asyncio.gather(*(engine.generate([1, 2, 3], sampling, f"r{i}") for i in range(4)))
        assert engine.servers[1].restarts == 1
        generation = await engine.generate([1, 2, 3], sampling, "after")
        assert generation.version_spans[0].version == 1
        await engine.close()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()
    assert all(not s.alive() for s in engine.servers)


@pytest.mark.slow
def test_a_lora_run_ships_each_version_as_its_adapter_to_launched_servers_and_resumes_after_sigkill(tiny_dirs, database_url, db, tmp_path):
    """The servers loopline launches for a LoRA run get LoRA enabled for its rank, keep the base model, and load
    each version's adapter (what the ledger's `adapter_uri` names); killed during a weight sync, the resumed
    trainer's new server loads the newest adapter before it generates."""
    name = f"sglang-lora-{tmp_path.name[-12:]}".replace("_", "-")
    engine = {"kind": "sglang", "launch": {"replicas": 1, "module": STAND_IN, "startup_timeout_s": 60}}
    config, env = _sglang_run(tmp_path, name, tiny_dirs["v0"], database_url, engine, steps=3)
    data = yaml.safe_load(config.read_text())
    data["learner"] = {**data["learner"], "lora": {"rank": 4}}
    config.write_text(yaml.safe_dump(data))
    _kill_at_each_then_resume(config, env, ["weight_sync"], tmp_path)
    run_id = _checked_run(db, name)
    rows = _rows(db, "SELECT version, adapter_uri FROM policy_version WHERE run_id = :r ORDER BY version", r=run_id)
    assert [v for v, _ in rows] == [0, 1, 2, 3] and rows[0][1] is None
    for version, uri in rows[1:]:
        adapter = path_on_publisher(uri)
        assert Path(adapter, "adapter_config.json").is_file() and Path(adapter).stat().st_size > 0, (version, adapter)
        assert f"v{version:06d}" in adapter
    replica_logs = (tmp_path / "home" / "runs" / name / "sglang").glob("sglang-*.log")
    starts = [line for p in replica_logs for line in p.read_text().splitlines() if "starting replica" in line]
    assert len(starts) == 2 and all("--enable-lora --max-lora-rank 4 --lora-target-modules all" in s for s in starts), starts
    assert all(f"--model-path {tiny_dirs['v0']}" in s for s in starts)  # the base, also for the resumed trainer's server
    # each step's trajectories were generated under the previous version's adapter, and the learner agrees with the
    # logprobs the server returned for them
    versions = _rows(db, "SELECT s.step, min(t.policy_version_min), max(t.policy_version_max) FROM trajectory t "
                         "JOIN slot s ON s.id = t.slot_id WHERE t.run_id = :r AND t.split = 'train' GROUP BY 1 ORDER BY 1", r=run_id)
    assert versions == [(1, 0, 0), (2, 1, 1), (3, 2, 2)]
    gaps = _rows(db, "SELECT step, value FROM metric WHERE run_id = :r AND name = 'logprob_abs_diff' ORDER BY 1", r=run_id)
    assert len(gaps) == 3 and all(value < 1e-4 for _, value in gaps), gaps
    assert _rows(db, "SELECT served_version FROM engine_server WHERE run_id = :r ORDER BY registered_at DESC LIMIT 1", r=run_id) == [(3,)]
