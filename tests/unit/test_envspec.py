"""Environment specs, tasks, the calculator, verifiers and episodes on the local backend (no services)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from loopline.envregistry.calculator import CalculatorError, calculate
from loopline.envregistry.registry import prepare
from loopline.envregistry.episode import Episode, ToolCall
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.envregistry.sandbox.local import AGENT_UID, LocalSandbox
from loopline.envregistry.sandbox.local import cleanup_orphans as local_cleanup_orphans
from loopline.envregistry.spec import LocalSettings, load_spec
from loopline.envregistry.tasks import EVAL_TEMPLATES, TRAIN_TEMPLATES, Task, load_tasks
from loopline.envregistry.verifiers import evaluate_expression, parse_verdict, verify_arithmetic
from loopline.errors import LooplineError
from tests.envfiles import JSONL_SPEC, ROWS, write_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = EXAMPLES / "arithmetic_env.yaml"


def _error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(LooplineError) as info:
        load_spec(path)
    return str(info.value)


def test_spec_error_names_file_line_and_field(tmp_path):
    text = ARITHMETIC.read_text().replace("backend: local", "backend: podman")
    line = text.splitlines().index(next(l for l in text.splitlines() if "backend: podman" in l)) + 1
    message = _error(tmp_path, text)
    assert f"bad.yaml:{line}: sandbox.backend:" in message
    assert "unknown sandbox backend 'podman'; one of: docker, e2b, local" in message


def test_spec_error_inside_the_task_source_has_the_real_path(tmp_path):
    message = _error(tmp_path, ARITHMETIC.read_text().replace("train_size: 2000", "train_size: many"))
    assert "tasks.train_size:" in message and "valid integer" in message


@pytest.mark.parametrize(("change", "says"), [
    (("prompt: \"{prompt}\"", "prompt: \"{promt}\""), "reset.prompt: {promt} is no placeholder here; did you mean {prompt}?"),
    (("observation: \"<result>{output}</result>\"", "observation: \"<result>{stdout}</result>\""), "reset.observation: {stdout} is no placeholder here; the one there is {output}"),
    (("versions: {env: \"1\",", "versions: {env: \"\","), "versions.env: String should have at least 1 character"),
])
def test_a_placeholder_no_task_fills_and_an_empty_version_are_refused(change, says, tmp_path):
    """`reset.prompt: "{promt}"` was registered and shown to the model as it is (`envreg test` passed it);
    `versions: {env: ""}` recorded an empty version on every trajectory."""
    text = ARITHMETIC.read_text()
    assert change[0] in text
    assert says in _error(tmp_path, text.replace(change[0], change[1], 1))
    assert load_spec_text_ok(text.replace('prompt: "{prompt}"', 'prompt: "Solve {prompt}; answer as {\\"x\\": 1}"'), tmp_path)


def load_spec_text_ok(text: str, tmp_path) -> bool:
    path = tmp_path / "ok.yaml"
    path.write_text(text)
    return load_spec(path).reset.prompt.startswith("Solve {prompt}")  # (other braces are text: JSON in a prompt)


def test_malformed_yaml_and_unknown_fields_are_reported(tmp_path):
    assert "bad.yaml:3: not valid YAML" in _error(tmp_path, "name: x\nsandbox:\n\tbackend: local\n")
    message = _error(tmp_path, ARITHMETIC.read_text() + "colour: blue\n")
    assert "colour: Extra inputs are not permitted" in message


def test_each_sandbox_backend_has_its_own_settings_and_a_spec_stored_before_keeps_its_hash(tmp_path):
    """`image` is docker's, `template` e2b's, `unsafe_host` local's: elsewhere each is refused by name, at its line. A
    spec stored before the backends had settings of their own (each holding the others' at their defaults) reads as
    the same spec, with the same hash (its registered version, and the starter built for it)."""
    from loopline.envregistry.spec import DockerSettings, EnvSpec, LocalSettings, spec_hash

    text = ARITHMETIC.read_text()
    assert "bad.yaml:10: sandbox.image: not a setting of this backend; it is docker's" in _error(
        tmp_path, text.replace("  backend: local ", "  image: python:3.12\n  backend: local "))
    (tmp_path / "docker.yaml").write_text(text.replace("  backend: local ", "  image: python:3.12\n  backend: docker "))
    docker = load_spec(tmp_path / "docker.yaml")
    assert isinstance(docker.sandbox, DockerSettings) and docker.sandbox.image == "python:3.12"
    spec = load_spec(ARITHMETIC)
    assert isinstance(spec.sandbox, LocalSettings) and not spec.sandbox.unsafe_host and spec.sandbox.needs_bubblewrap
    stored = spec.canonical()
    assert {"image": None, "template": None, "unsafe_host": False}.items() <= stored["sandbox"].items()
    assert EnvSpec.model_validate(stored) == spec and spec_hash(EnvSpec.model_validate(stored).canonical()) == spec_hash(stored)


def test_a_sandbox_backend_of_a_module_in_imports_is_valid_and_a_missing_module_is_one_line(tmp_path, monkeypatch):
    """`imports:` is imported before the rest is checked (a plugin's backend name is valid); a spec without it keeps
    its hash; a module that cannot be imported is refused at its line."""
    (tmp_path / "envspec_toy_backend.py").write_text(
        "from loopline.envregistry.spec import SANDBOX_BACKENDS\n"
        "SANDBOX_BACKENDS.register('envspec_toy')(lambda spec, labels, model: None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    text = ARITHMETIC.read_text()
    plugged = tmp_path / "plugged.yaml"
    plugged.write_text("imports: [envspec_toy_backend]\n" + text.replace("backend: local", "backend: envspec_toy"))
    spec = load_spec(plugged)
    assert spec.sandbox.backend == "envspec_toy" and spec.imports == ("envspec_toy_backend",)
    assert "imports" not in load_spec(ARITHMETIC).canonical() and spec.canonical()["imports"] == ["envspec_toy_backend"]
    message = _error(tmp_path, "imports:\n  - not_a_module_anywhere\n" + text)
    assert "bad.yaml:1: imports: cannot import 'not_a_module_anywhere' (ModuleNotFoundError" in message, message


def test_docker_backend_needs_an_image(tmp_path):
    message = _error(tmp_path, ARITHMETIC.read_text().replace("backend: local", "backend: docker"))
    assert "bad.yaml:9: sandbox.image: Field required" in message


def test_tool_template_must_use_declared_args(tmp_path):
    message = _error(tmp_path, JSONL_SPEC.format(name="x").replace('"{cmd}"', '"{command}"'))
    assert "tools.0:" in message and "{command}" in message


def test_arithmetic_problem_split_holds_out_problems():
    spec = load_spec(ARITHMETIC)  # the example uses this split
    tasks = load_tasks(spec, EXAMPLES)
    assert tasks == load_tasks(spec, EXAMPLES)
    train = [t for t in tasks if t.split == "train"]
    evals = [t for t in tasks if t.split == "eval"]
    assert (len(train), len(evals)) == (2000, 200)
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert {t.data["template"] for t in evals} == {t.data["template"] for t in train}
    for t in tasks[:300] + evals:
        assert evaluate_expression(t.data["expression"]) == t.data["answer"] == calculate(t.data["expression"])


def test_arithmetic_operand_split_holds_out_larger_numbers(tmp_path):
    path = tmp_path / "env.yaml"
    path.write_text(ARITHMETIC.read_text().replace("params: {max_operand: 79, split: problems}", "params: {max_operand: 99, split: operands, eval_min_operand: 80}"))
    tasks = load_tasks(load_spec(path), tmp_path)
    numbers = lambda t: [int(x) for x in re.findall(r"\d+", t.data["expression"])]  # noqa: E731
    assert all(max(numbers(t)) < 80 for t in tasks if t.split == "train")
    assert all(max(numbers(t)) >= 80 for t in tasks if t.split == "eval")


def test_arithmetic_template_split_holds_out_a_whole_form(tmp_path):
    path = tmp_path / "env.yaml"
    path.write_text(ARITHMETIC.read_text().replace("split: problems", "split: templates"))
    tasks = load_tasks(load_spec(path), tmp_path)
    assert {t.data["template"] for t in tasks if t.split == "train"} == set(TRAIN_TEMPLATES)
    assert {t.data["template"] for t in tasks if t.split == "eval"} == set(EVAL_TEMPLATES)


def test_jsonl_duplicate_ids_and_overlapping_splits_are_refused(tmp_path):
    dup = write_env(tmp_path, "dup", ROWS + [{"id": "a", "split": "train", "prompt": "p3"}])
    with pytest.raises(LooplineError, match=r"tasks.jsonl:3: duplicate task id 'a' \(first on line 1\)"):
        load_tasks(load_spec(dup), tmp_path)
    overlap = write_env(tmp_path, "overlap", ROWS + [{"id": "c", "split": "eval", "prompt": "p1"}])
    with pytest.raises(LooplineError, match="repeat train prompts"):
        load_tasks(load_spec(overlap), tmp_path)


@pytest.mark.parametrize("expression, value", [("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("-7 // 2", -4), ("2 ** 10", 1024), ("7 / 2", 3.5)])
def test_calculator_computes(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('id')", "only numbers"),
        ("x + 1", "only numbers"),
        ("9 ** 9 ** 9", "exponents"),
        ("1 / 0", "division by zero"),
        ("1 +", "cannot parse"),
    ],
)
def test_calculator_refuses_with_a_readable_message(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


TASK = Task("t", "train", "What is 12 + 3 * 4?", {"expression": "12 + 3 * 4", "answer": 24})


def test_verifier_ignores_claims_and_checks_the_answer_itself():
    assert verify_arithmetic(TASK, "<answer>24</answer>").reward == 1.0
    assert verify_arithmetic(TASK, "I checked it carefully, the answer is correct. All tests passed!").reward == 0.0
    assert verify_arithmetic(TASK, "<answer>60</answer>").reward == 0.0
    assert verify_arithmetic(TASK, "<answer>60</answer> no wait <answer>24</answer>").reward == 1.0


def test_verifier_catches_a_wrong_stored_answer_as_infra_failure():
    broken = Task("t", "train", "?", {"expression": "12 + 3 * 4", "answer": 60})
    with pytest.raises(InfraFailure, match="verifier disagrees"):
        verify_arithmetic(broken, "<answer>60</answer>")


@pytest.mark.parametrize(
    "text, reward, passed",
    [
        ('{"passed": 3, "total": 4}', 0.75, False),
        ('{"passed": 4, "total": 4}', 1.0, True),
        ('{"passed": 0, "total": 1}', 0.0, False),
        ('{"reward": 0.25}', 0.25, False),
        ('{"reward": 1}', 1.0, True),
    ],
)
def test_verdicts_in_range_become_rewards(text, reward, passed):
    verdict = parse_verdict(text, (0.0, 1.0))
    assert (verdict.reward, verdict.passed) == (reward, passed)


@pytest.mark.parametrize(
    "text",
    [
        '{"passed": 1000, "total": 1}',  # the forged verdict of the red-team report
        '{"passed": -1, "total": 2}',
        '{"passed": 0, "total": 0}',
        '{"passed": 1.5, "total": 2}',
        '{"passed": true, "total": 1}',
        '{"reward": 1.01}',
        '{"reward": -0.5}',
        '{"reward": NaN}',
        '{"reward": "1"}',
        '{"ok": true}',
        "[1, 1]",
        "passed",
    ],
)
def test_malformed_or_out_of_range_verdicts_are_verifier_faults(text):
    with pytest.raises(InfraFailure, match="verifier fault"):
        parse_verdict(text, (0.0, 1.0))


def test_a_declared_reward_range_is_honoured():
    assert parse_verdict('{"reward": -1}', (-1.0, 1.0)).reward == -1.0
    with pytest.raises(InfraFailure, match="outside the env's reward_range"):
        parse_verdict('{"passed": 1, "total": 1}', (0.0, 0.5))


def test_bad_tool_calls_are_observations_not_crashes():
    spec = load_spec(ARITHMETIC)

    async def play():
        episode = await Episode.start(spec, TASK)
        try:
            return [
                await episode.step(ToolCall("calc", {"expression": "12 + 3 * 4"})),
                await episode.step(ToolCall("shell", {"cmd": "ls"})),
                await episode.step(ToolCall("calc", {})),
                await episode.step(ToolCall("calc", {"expression": 5})),
                await episode.step(ToolCall("calc", {"expression": "open('x')"})),
            ]
        finally:
            await episode.close()

    ok, unknown, missing, wrong_type, refused = asyncio.run(play())
    assert (ok.text, ok.error) == ("24", False)
    assert unknown.error and "no tool named 'shell' (tools: calc)" in unknown.text
    assert missing.error and "missing argument 'expression'" in missing.text
    assert wrong_type.error and "must be a string" in wrong_type.text
    assert refused.error and "only numbers" in refused.text


def _local(**resources) -> LocalSandbox:
    return LocalSandbox(LocalSettings(backend="local", resources=resources or {}))


AS_A_USER = """
import asyncio, json, sys
from loopline.envregistry.sandbox.local import LocalSandbox
from loopline.envregistry.spec import LocalSettings

async def go():
    box = LocalSandbox(LocalSettings(backend="local", resources=json.loads(sys.argv[1])))
    try:
        result = await box.exec(sys.argv[2], timeout_s=60)
        owner = (box.files / "mine").stat().st_uid if (box.files / "mine").exists() else None
        print(json.dumps([result.stdout, result.stderr, owner]))
    finally:
        await box.close()

asyncio.run(go())
"""


def _exec_as_a_user(command: str, uid: int = 4242, **resources) -> tuple[str, str, int | None]:
    """`command` in a local sandbox that loopline, running as `uid` (not root), made: stdout, stderr and the owner
    of the file `mine` in the workdir, if made. (The system python3, which CI gives the agent libraries, pydantic
    among them: this process's may sit in a home that uid cannot enter.)"""
    import json
    import subprocess

    ran = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "/usr/bin/python3", "-c", AS_A_USER,
         json.dumps(resources), command],
        capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "TMPDIR": "/tmp"},
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    return tuple(json.loads(ran.stdout.splitlines()[-1]))


def test_local_sandbox_timeout_kills_the_command():
    async def go():
        box = _local()
        try:
            return await box.exec("sleep 30", timeout_s=0.5)
        finally:
            await box.close()

    result = asyncio.run(go())
    assert result.timed_out and not result.ok and result.seconds < 5


def test_local_sandbox_memory_limit():
    async def go():
        box = _local(memory_mb=64)
        try:
            return await box.exec("python3 -c 'x = bytearray(512 * 1024 * 1024)'", timeout_s=30)
        finally:
            await box.close()

    result = asyncio.run(go())
    assert not result.ok and "MemoryError" in result.stderr


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (.ci/run installs it)")
def test_local_sandbox_has_no_network_and_cleans_up():
    probe = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 5432), timeout=2); print('connected')\""
    assert "connected" in subprocess.run(probe, shell=True, capture_output=True, text=True).stdout  # reachable outside

    async def go():
        box = _local()
        assert box.isolated
        await box.write_file("notes/a.txt", "hello")
        result = await box.exec(f"cat notes/a.txt && {probe}", timeout_s=10)
        await box.close()
        return box, result

    box, result = asyncio.run(go())
    assert result.stdout.startswith("hello") and "connected" not in result.stdout and not result.ok
    assert "ConnectionRefusedError" in result.stderr  # python3 ran (the sandbox has one); its loopback reaches nothing
    assert not box.root.exists()


NEEDS_BWRAP = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (.ci/run installs it)")
# what an agent must not see of the host; prints each thing it finds
HOST_PROBE = (
    f"for p in /root/. /home/*/. /work/. {Path(__file__).resolve()} /var/run/postgresql/.s.PGSQL.5432 /var/run/docker.sock "
    "/run/docker.sock /tmp/.X11-unix /run/dbus; do [ -e \"$p\" ] && echo \"found $p\"; done; "
    "[ $(ls -d /proc/[0-9]* | wc -l) -gt 10 ] && echo 'found other processes'; "
    "grep -q '^CapEff:[[:space:]]*0*$' /proc/self/status || echo 'found capabilities'; id -u; touch mine; echo probed"
)


@NEEDS_BWRAP
@pytest.mark.parametrize("loopline_as", ["root", "user"])
def test_local_sandbox_shows_the_agent_nothing_of_the_host(loopline_as):
    """As root the agent is the unprivileged AGENT_UID; as a user (here: the prefix run under uid 4242 with the
    workdir its own, as when loopline runs as that user) it is that user. Either way: no host files, sockets,
    processes or capabilities."""
    if os.geteuid() != 0:
        pytest.skip("needs root (to run as root, and to become another user)")

    async def go():
        box = _local()
        try:
            result = await box.exec(HOST_PROBE, timeout_s=30)
            return result.stdout, result.stderr, (box.files / "mine").stat().st_uid
        finally:
            await box.close()

    if loopline_as == "root":
        (stdout, stderr, owner), uid = asyncio.run(go()), AGENT_UID
    else:
        (stdout, stderr, owner), uid = _exec_as_a_user(HOST_PROBE), 4242
    assert stdout.endswith("probed\n") and "found" not in stdout, stdout + stderr
    assert f"\n{uid}\n" in f"\n{stdout}" and owner == uid  # inside and on the host


# fills each filesystem the agent can reach but its workdir with 400 MB; prints what each held (KiB)
STORE_PROBE = (
    "for d in / /dev /tmp /dev/shm; do dd if=/dev/zero of=$d/fill bs=1M count=400 2>/dev/null; "
    "echo \"$d $(du -sk $d/fill 2>/dev/null | cut -f1)\"; rm -f $d/fill; done; "
    "unshare -rm true 2>/dev/null && echo 'made a user namespace'; echo probed"
)


@NEEDS_BWRAP
@pytest.mark.parametrize("loopline_as", ["root", "user"])
def test_local_sandbox_bounds_the_memory_its_filesystems_hold(loopline_as):
    """/, /dev, /tmp and /dev/shm are memory (tmpfs), which RLIMIT_AS does not bound: one tool call with
    memory_mb 512 stored 3 GB. Now / and /dev are read-only, /tmp holds half of memory_mb and /dev/shm a
    quarter, and no user namespace (where another tmpfs could be mounted) can be made."""
    if os.geteuid() != 0 and loopline_as == "user":
        pytest.skip("needs root (to become another user)")

    async def go():
        box = _local(memory_mb=256)
        try:
            result = await box.exec(STORE_PROBE, timeout_s=60)
            return result.stdout, result.stderr
        finally:
            await box.close()

    if loopline_as == "root" or os.geteuid() != 0:
        stdout, stderr = asyncio.run(go())
    else:
        stdout, stderr, _ = _exec_as_a_user(STORE_PROBE, memory_mb=256)
    held = dict(line.split(" ") if " " in line else (line, "") for line in stdout.splitlines()[:4])
    assert stdout.endswith("probed\n") and "user namespace" not in stdout, stdout + stderr
    assert (held["/"], held["/dev"]) == ("", "")  # read-only: nothing written
    assert 0 < int(held["/tmp"]) <= 128 * 1024 and 0 < int(held["/dev/shm"]) <= 64 * 1024, held


@NEEDS_BWRAP
def test_local_sandbox_enforces_pids_per_command():
    """`pids: 8` holds for the command's whole process tree (205 processes ran before), whatever else runs as its uid."""
    fork = (
        "python3 -c \"import os, time\nn = 0\nfor _ in range(300):\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n    n += 1\nprint('forked', n)\""
    )

    async def go():
        boxes = [_local(pids=8), _local(pids=8)]  # two at once: each has its own count
        try:
            return await asyncio.gather(*(b.exec(fork, timeout_s=30) for b in boxes))
        finally:
            for b in boxes:
                await b.close()

    for result in asyncio.run(go()):
        forked = int(result.stdout.split()[-1])
        assert 3 <= forked <= 6, result.stdout + result.stderr  # 8 with bwrap's init and python itself


def _hold_local_sandbox(out) -> None:
    box = LocalSandbox(LocalSettings(backend="local"))
    out.put(str(box.root))
    time.sleep(600)


def test_local_sandbox_of_a_crashed_process_is_cleaned_up():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_hold_local_sandbox, args=(out,), daemon=True)
    proc.start()
    root = Path(out.get(timeout=60))
    proc.kill()
    proc.join(timeout=10)
    mine = LocalSandbox(LocalSettings(backend="local"))  # a live owner's sandbox must survive
    try:
        assert root.exists()
        assert str(root) in local_cleanup_orphans()
        assert not root.exists() and mine.root.exists()
    finally:
        asyncio.run(mine.close())


def test_sandbox_paths_cannot_escape():
    async def go():
        box = _local()
        try:
            await box.write_file("../../etc/evil", "x")
        finally:
            await box.close()

    with pytest.raises(PermissionError, match="leaves the sandbox"):
        asyncio.run(go())


def test_local_backend_refuses_unisolated_commands_unless_unsafe_host(monkeypatch):
    monkeypatch.setattr("loopline.envregistry.sandbox.local.shutil.which", lambda name: None)

    async def run(spec):
        box = LocalSandbox(spec)
        try:
            return await box.exec("echo $((6 * 7))", 5)
        finally:
            await box.close()

    with pytest.raises(InfraFailure, match="needs bubblewrap"):
        asyncio.run(run(LocalSettings(backend="local")))
    assert asyncio.run(run(LocalSettings(backend="local", unsafe_host=True))).stdout == "42\n"


def test_an_environment_version_beyond_the_ledgers_integers_is_one_line():
    from loopline.envregistry.registry import parse_ref

    assert parse_ref("arithmetic@2") == ("arithmetic", 2) and parse_ref("arithmetic") == ("arithmetic", None)
    for ref in ("arithmetic@2147483648", "arithmetic@" + "9" * 5000, "arithmetic@x", "arithmetic@\u0661"):
        with pytest.raises(LooplineError, match="below 10\\^9"):
            parse_ref(ref)


def test_a_field_added_later_at_its_default_leaves_a_specs_hash_as_it_was(tmp_path):
    """`tool_calls: tags` (the default) is not in the canonical form: the examples keep the hash they were
    registered under, and the shipped starter its name; another value is part of it."""
    from loopline.envregistry.registry import content_hash
    from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_name

    assert (SHIPPED_STARTERS / tiny_policy_name(content_hash(ARITHMETIC), 0) / "config.json").is_file()
    text = ARITHMETIC.read_text()
    for value, same in (("tags", True), ("hermes", False)):
        (tmp_path / "env.yaml").write_text(text + f"tool_calls: {value}\n")
        assert (content_hash(tmp_path / "env.yaml") == content_hash(ARITHMETIC)) == same


@pytest.mark.parametrize(
    ("sandbox", "refused"),
    [
        ({"backend": "local"}, None),
        ({"backend": "docker", "image": "loopline-agent:bookworm"}, None),
        ({"backend": "docker", "image": "loopline-agent:bookworm", "network": True}, "network: false"),
        ({"backend": "e2b", "template": "base"}, None),
        ({"backend": "e2b", "template": "base", "network": True}, "network: false"),
    ],
)
def test_an_agent_program_runs_only_where_its_only_way_out_is_the_endpoint(tmp_path, sandbox, refused):
    import yaml

    examples = Path(__file__).resolve().parents[2] / "examples"
    spec = yaml.safe_load((examples / "arithmetic_agent_env.yaml").read_text()) | {"sandbox": sandbox}
    spec["agent"]["files"] = {"agent.py": str(examples / "arithmetic_agent.py")}
    (tmp_path / "env.yaml").write_text(yaml.safe_dump(spec))
    if refused is None:
        assert load_spec(tmp_path / "env.yaml").sandbox.backend == sandbox["backend"]
    else:
        with pytest.raises(LooplineError, match=refused):
            load_spec(tmp_path / "env.yaml")


def test_a_verifier_file_beside_the_spec_is_registered_as_its_text(tmp_path):
    """coding_env keeps its test runner as a real file (`verifier.files`): it hashes as the same text inline
    did (the registered version stays), a missing file or a name written twice is one line naming the field."""
    import yaml

    from loopline.envregistry.registry import content_hash

    examples = Path(__file__).resolve().parents[2] / "examples"
    spec = load_spec(examples / "coding_env.yaml")
    runner = (examples / "coding_run_tests.py").read_text()
    assert spec.verifier.support_files == {"run_tests.py": runner} and spec.verifier.files == {}
    data = yaml.safe_load((examples / "coding_env.yaml").read_text())
    shutil.copy(examples / data["tasks"]["path"], tmp_path)  # (the task file's path is part of the spec)
    data["verifier"]["support_files"] = {"run_tests.py": runner}
    del data["verifier"]["files"]
    (tmp_path / "inline.yaml").write_text(yaml.safe_dump(data))
    assert content_hash(tmp_path / "inline.yaml") == content_hash(examples / "coding_env.yaml")
    data["verifier"]["files"] = {"run_tests.py": "missing.py"}
    del data["verifier"]["support_files"]
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(LooplineError, match=r"verifier.files\['run_tests.py'\]: .*missing.py: no such file"):
        load_spec(tmp_path / "missing.yaml")
    data["verifier"]["support_files"] = {"run_tests.py": "print()"}
    (tmp_path / "twice.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(LooplineError, match="both write 'run_tests.py'; keep one"):
        load_spec(tmp_path / "twice.yaml")


@NEEDS_BWRAP
def test_as_root_a_temp_dir_the_agent_cannot_enter_is_one_line_before_any_episode(monkeypatch):
    """As root the agent's uid must pass through TMPDIR to its workdir; a 0700 TMPDIR (a CI's, a user's
    private one) made every command fail with bwrap's `Can't find source path`, and an agent env retried its
    episodes forever. Both registering the env and opening a sandbox now say what to do."""
    if os.geteuid() != 0:
        pytest.skip("needs root (loopline as root runs the agent as another uid)")
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # (pytest's tmp_path is itself under a 0700 directory)
    base.chmod(0o755)
    private = base / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr("tempfile.tempdir", str(private))
    with pytest.raises(LooplineError, match=rf"cannot pass through {private} \(mode 700\): set TMPDIR"):
        prepare(EXAMPLES / "arithmetic_agent_env.yaml")  # (an agent program: runs in the local sandbox)
    with pytest.raises(InfraFailure, match="set TMPDIR to a directory every user can enter"):
        _local()
    private.chmod(0o711)  # passable, not listable: enough
    box = _local()
    try:
        result = asyncio.run(box.exec("id -u", timeout_s=30))
        assert result.stdout.strip() == str(AGENT_UID), result.stderr
    finally:
        asyncio.run(box.close())
        shutil.rmtree(base)


def _agent_on_e2b(tmp_path):
    import yaml

    examples = Path(__file__).resolve().parents[2] / "examples"
    spec = yaml.safe_load((examples / "arithmetic_agent_env.yaml").read_text()) | {"sandbox": {"backend": "e2b", "template": "base"}}
    spec["agent"]["files"] = {"agent.py": str(examples / "arithmetic_agent.py")}
    (tmp_path / "env.yaml").write_text(yaml.safe_dump(spec))
    return load_spec(tmp_path / "env.yaml")


def test_an_agent_program_on_e2b_needs_the_endpoints_public_url_before_any_episode(tmp_path, monkeypatch):
    """E2B's cloud reaches the endpoint over the internet: without where it listens and where the cloud reaches
    it, the run stops at once with one line naming both variables (not an infra failure retried per episode)."""
    from loopline.rollout.harness import agent_program

    spec = _agent_on_e2b(tmp_path)
    monkeypatch.setattr(agent_program, "_endpoint", None)  # (none started by an earlier test in this process)
    monkeypatch.delenv(agent_program.URL_VAR, raising=False)
    monkeypatch.delenv(agent_program.LISTEN_VAR, raising=False)
    with pytest.raises(LooplineError, match=f"set {agent_program.LISTEN_VAR}=HOST:PORT .* and {agent_program.URL_VAR}=URL"):
        agent_program.check_reachable(spec)
    monkeypatch.setenv(agent_program.URL_VAR, "trainer.example.com:8443")
    monkeypatch.setenv(agent_program.LISTEN_VAR, "0.0.0.0:8765")
    with pytest.raises(LooplineError, match="give the URL at which E2B reaches this process"):
        agent_program.check_reachable(spec)
    monkeypatch.setenv(agent_program.URL_VAR, "https://trainer.example.com:8443")
    monkeypatch.setenv(agent_program.LISTEN_VAR, "8765")
    with pytest.raises(LooplineError, match="give HOST:PORT"):
        agent_program.check_reachable(spec)
    monkeypatch.setattr(agent_program, "_endpoint", None)
    monkeypatch.setenv(agent_program.LISTEN_VAR, "127.0.0.1:0")
    agent_program.check_reachable(spec)
    started = agent_program._endpoint
    assert started is not None and started.host == "127.0.0.1"
    monkeypatch.setenv(agent_program.LISTEN_VAR, "127.0.0.2:0")  # set after this process's endpoint started elsewhere
    with pytest.raises(LooplineError, match=f"already listens on 127.0.0.1:{started.port}, started before {agent_program.LISTEN_VAR}"):
        agent_program.check_reachable(spec)
    started.stop()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(agent_program, "_endpoint", None)
        monkeypatch.setenv(agent_program.LISTEN_VAR, f"127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(LooplineError, match="cannot listen on 127.0.0.1:.*set LOOPLINE_AGENT_ENDPOINT_LISTEN to a free HOST:PORT"):
            agent_program.check_reachable(spec)
    monkeypatch.delenv(agent_program.URL_VAR)
    agent_program.check_reachable(load_spec(Path(__file__).resolve().parents[2] / "examples" / "arithmetic_agent_env.yaml"))  # local


def test_e2b_agent_sandbox_asks_the_cloud_for_only_the_endpoint(tmp_path, monkeypatch):
    """What the real SDK sends E2B's control plane for an agent program's sandbox (its create call captured: the
    cloud is not reachable here): every outbound address denied but the public URL's host, which E2B's allow
    list lets through (allowed entries take precedence); without a model, `network` maps to internet access."""
    import e2b

    from loopline.envregistry.sandbox.backends import open_sandbox
    from loopline.envregistry.sandbox.base import ModelEndpoint

    asked = []

    class Ran:
        exit_code, stdout, stderr = 0, "", ""

    class Box:
        class commands:
            @staticmethod
            async def run(*args, **kwargs):
                return Ran()

        @staticmethod
        async def kill():
            return True

    async def create(**kwargs):
        asked.append(kwargs)
        return Box()

    monkeypatch.setattr(e2b.AsyncSandbox, "create", create)
    spec = _agent_on_e2b(tmp_path).sandbox

    async def both():
        with_model = await open_sandbox(spec, model=ModelEndpoint("/unused.sock", "https://trainer.example.com:8443"))
        plain = await open_sandbox(spec)
        assert with_model.model_url(ModelEndpoint("/unused.sock", "https://trainer.example.com:8443/")) == "https://trainer.example.com:8443"
        await with_model.close()
        await plain.close()

    asyncio.run(both())
    assert asked[0]["network"] == {"deny_out": ["0.0.0.0/0"], "allow_out": ["trainer.example.com"]}
    assert "allow_internet_access" not in asked[0]
    assert asked[1]["allow_internet_access"] is False and "network" not in asked[1]


@NEEDS_BWRAP
def test_an_optional_argument_left_out_is_empty_and_bytes_no_sandbox_can_carry_are_told_to_the_model():
    """Each was an exception out of the episode (KeyError, ValueError: embedded null byte, UnicodeEncodeError),
    recorded as an infrastructure failure: a policy's way out of its zero."""
    from loopline.envregistry.spec import LocalSettings, Tool, ToolArg

    greet = Tool(name="greet", description="d", command="printf '[%s|%s]' {name} {title}", args={"name": ToolArg(), "title": ToolArg(required=False)})
    spec = load_spec(ARITHMETIC).model_copy(update={"tools": (greet,), "sandbox": LocalSettings(backend="local")})

    async def play():
        episode = await Episode.start(spec, TASK)
        try:
            return [await episode.step(ToolCall("greet", args)) for args in (
                {"name": "ada"}, {"name": "a\x00b"}, {"name": "\ud800"}, {"name": "x" * 200_000}, {"name": "ada", "title": "dr"},
            )]
        finally:
            await episode.close()

    left_out, nul, surrogate, huge, both = asyncio.run(play())
    assert (left_out.text, left_out.error) == ("[ada|]", False)
    assert nul.error and "NUL" in nul.text
    assert surrogate.error and "not valid Unicode" in surrogate.text
    assert huge.error and "bytes, over the 131,072 one command may hold" in huge.text
    assert (both.text, both.error) == ("[ada|dr]", False)


def test_outputs_a_verifier_receives_are_the_named_regular_files_within_the_limits(monkeypatch):
    """Patterns match the whole relative path (`*` also across `/`); in path order, files past the count or
    byte limit are left out with the reason, and a spec without `outputs` takes every file."""
    from loopline.envregistry import spec as env_spec
    from loopline.envregistry.sandbox.base import choose_outputs

    listing = [("b/deep/x.py", 5), ("solution.py", 10), ("notes.txt", 3), ("a.py", 7)]
    assert choose_outputs(listing, ("*.py",)) == (["a.py", "b/deep/x.py", "solution.py"], {})
    assert choose_outputs(listing, ("solution.py", "b/*")) == (["b/deep/x.py", "solution.py"], {})
    assert choose_outputs(listing, None)[0] == ["a.py", "b/deep/x.py", "notes.txt", "solution.py"]
    monkeypatch.setattr(env_spec, "MAX_OUTPUT_BYTES", 12)
    monkeypatch.setattr(env_spec, "MAX_OUTPUT_FILES", 2)
    chosen, left_out = choose_outputs(listing, None)
    assert chosen == ["a.py", "b/deep/x.py"]  # 7 + 5 = 12 bytes, 2 files
    assert left_out == {"notes.txt": "over the 2 files a verifier receives", "solution.py": "over the 2 files a verifier receives"}
    monkeypatch.setattr(env_spec, "MAX_OUTPUT_FILES", 10)
    assert choose_outputs(listing, None) == (["a.py", "b/deep/x.py"], {
        "notes.txt": "over the 0 MiB a verifier receives", "solution.py": "over the 0 MiB a verifier receives",
    })


def test_verifier_outputs_are_relative_patterns_and_leave_older_specs_hashes_alone():
    from loopline.envregistry.spec import EnvSpec, spec_hash

    base = load_spec(EXAMPLES / "coding_env.yaml").canonical()
    assert base["verifier"]["outputs"] == ["solution.py"]
    without = {**base, "verifier": {k: v for k, v in base["verifier"].items() if k != "outputs"}}
    parsed = EnvSpec.model_validate(without)
    assert parsed.verifier.outputs is None and "outputs" not in parsed.canonical()["verifier"]  # (its old hash)
    assert spec_hash(parsed.canonical()) == spec_hash(without)
    for bad in (["/etc/passwd"], ["../x"], ["a/../../x"]):
        with pytest.raises(ValidationError, match="relative path without"):
            EnvSpec.model_validate({**base, "verifier": {**base["verifier"], "outputs": bad}})
    with pytest.raises(ValidationError, match="outputs are for command verifiers"):
        EnvSpec.model_validate({**base, "verifier": {"builtin": "arithmetic_answer", "outputs": ["x"]}})
