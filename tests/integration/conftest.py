"""One Prefect API server for the integration tests' `loopline` processes.

Without a configured server every `loopline train` starts a temporary one of its own: measured on 2 cores, a
2-step tiny-policy run took 30-32 s of CPU with its own server and 18-20 s reporting to a running one (which
spent ~5 s a run serving it), ~2-4 s less wall time; the suite starts ~70 such processes. The tests about that
temporary server (it starts, dies with its parent, is replaced by a configured one) pop
PREFECT_API_URL from the environment they give their processes, as a user without a server stands.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_prefect_server_for_the_session(tmp_path_factory):
    from loopline.orchestration.server import TemporaryServer, configured_api_url

    if configured_api_url():  # a developer's own server (or CI's): the processes report there
        yield
        return
    server = TemporaryServer(tmp_path_factory.mktemp("prefect-server"))
    server.wait()
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        yield
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()
