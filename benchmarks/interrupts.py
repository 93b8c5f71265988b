"""Issue 29's campaign: a run interrupted 20 times (Ctrl-C and SIGKILL at random moments) with sparse exports
and checkpoints, default threads, the CPU loaded by other processes; then it must finish, pass `check`, and
every step must replay to its recorded digest.

    python -m benchmarks.interrupts [--interrupts 20] [--steps 30] [--load 2] [--seed 0]

The run is the quickstart's shape (shipped tiny starter, 8 groups x 8 samples, 48 new tokens) with
`checkpoint_every: 6` (a full checkpoint every 6 steps only, so most versions live in the learner's
memory alone), on a throwaway database (LOOPLINE_DATABASE_URL's server or the embedded one). Each round
starts `loopline train`, waits until its flow has begun and then a random 0-30 s (so a round's window
is not spent starting Python and torch), and sends SIGINT or SIGKILL (alternating); after a
SIGINT it also records how long the process took to leave and the run's status; a run that finishes before
its signal is extended by 10 steps (`train --resume RUN --steps N`) and the round tried again. Prints, per round, the
signal, the version reached and the status the run was left in, then the totals: finished, `check`,
replays matching, weight rebuilds recorded, and runs left `running` without a process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks._scratch import scratch_database

ROOT = Path(__file__).resolve().parent.parent


def _config(home: Path, name: str, steps: int) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "arithmetic_quickstart.yaml").read_text())
    data.update(name=name, env=str(ROOT / "examples" / "arithmetic_env.yaml"), steps=steps)
    data["rollout"].update(groups_per_step=8, lease_seconds=5)
    data["learner"]["checkpoint_every"] = 6
    data["eval"].update(every=6, tasks=20)
    path = home / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _state(engine, name: str) -> tuple[str, int, int]:
    """(status as `loopline runs` shows it, newest version, weight rebuilds)."""
    from loopline.store import ledger, queries
    from loopline.store.db import session

    with session(engine) as s:
        shown = {r.name: r for r in queries.list_runs(s)}
        if name not in shown:
            return "absent", 0, 0
        run = shown[name]
        rebuilds = sum(len(ledger.rebuilt_digests(s, run.id, v)) for v in range(run.policy_version + 1))
    return run.status, run.policy_version, rebuilds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interrupts", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    name = f"interrupts-{args.seed}"
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    started = time.monotonic()
    try:
        with scratch_database() as (url, engine), tempfile.TemporaryDirectory(prefix="loopline-interrupts-") as tmp:
            home = Path(tmp)
            config = _config(home, name, args.steps)
            env = {**os.environ, "LOOPLINE_DATABASE_URL": url, "LOOPLINE_HOME": str(home / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            env.pop("PREFECT_API_URL", None)
            left_running, rounds, steps, extend = 0, 0, args.steps, False
            while rounds < args.interrupts:
                kind = signal.SIGINT if rounds % 2 == 0 else signal.SIGKILL
                # the first round starts the run from its file; later ones resume it (and extend it when it finished)
                how = [str(config)] if rounds == 0 and not extend else ["--resume", name] + (["--steps", str(steps)] if extend else [])
                with (home / f"round-{rounds}.log").open("w") as log:
                    proc = subprocess.Popen([sys.executable, "-m", "loopline.cli", "train", *how], env=env, cwd=ROOT,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                    _until_flow_started(home / f"round-{rounds}.log", proc)  # under load, a start alone can take 30 s
                    time.sleep(rng.uniform(0, 30))
                    if proc.poll() is not None:  # it finished before the signal: train it on to 10 steps more, and try again
                        print(f"round {rounds}: the run finished at {steps} steps before the signal (exit {proc.returncode}); extending it")
                        steps, extend = steps + 10, True
                        continue
                    extend = False
                    os.kill(proc.pid, kind)
                    sent = time.monotonic()
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                    took = time.monotonic() - sent
                    with contextlib.suppress(ProcessLookupError):  # what it left in its group (nothing should be)
                        os.killpg(proc.pid, signal.SIGKILL)
                status, version, _ = _state(engine, name)
                if status == "running":
                    left_running += 1
                print(f"round {rounds}: {signal.Signals(kind).name:7s} at v{version:<3d} left in {took:4.1f} s, run shown as {status}")
                rounds += 1
            final = subprocess.run([sys.executable, "-m", "loopline.cli", "train", "--resume", name], env=env, cwd=ROOT,
                                   capture_output=True, text=True)
            status, version, rebuilds = _state(engine, name)
            check = subprocess.run([sys.executable, "-m", "loopline.cli", "check", name], env=env, cwd=ROOT, capture_output=True, text=True)
            code = (  # every step: a replay of step k compares the steps since the checkpoint it starts from too
                "import json\nfrom loopline.flows.replay import replay_step\n"
                f"k, seen = {version}, []\n"
                f"while k > 0:\n    r = replay_step({name!r}, k)\n    seen, k = r['steps'] + seen, r['from_step']\n"
                "print(json.dumps([s['reproduced'] for s in seen]))"
            )
            replays = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
            matched = json.loads(replays.stdout.strip().splitlines()[-1]) if replays.returncode == 0 else []
    finally:
        for hog in hogs:
            hog.kill()
    print(f"{rounds} interrupts, {args.load} busy processes beside, {(time.monotonic() - started) / 60:.1f} min")
    print(f"  final run: exit {final.returncode}, status {status}, v{version} of {steps}")
    if final.returncode != 0:
        print("    " + "\n    ".join((final.stdout + final.stderr).strip().splitlines()[-15:]))
    print(f"  check: {'ok' if check.returncode == 0 else 'VIOLATIONS'}; weight rebuilds recorded: {rebuilds}")
    print(f"  replays matching their recorded digest: {sum(matched)}/{version}"
          + (f" (different: steps {', '.join(str(k + 1) for k, ok in enumerate(matched) if not ok)})" if not all(matched) else ""))
    print(f"  runs shown as running with no process, after an interrupt: {left_running}")
    if replays.returncode != 0:
        print("  the replays failed:\n    " + "\n    ".join(replays.stderr.strip().splitlines()[-15:]))


def _until_flow_started(log: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while "Beginning flow run" not in log.read_text(errors="replace") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
