"""What an outage looks like from loopline's connections: the test proxy's cut behaves as a server that went
away (both ends see the connection end; nothing is left half-open), and a network that silently drops a
connection (no FIN, no reset: a partition, a host that died) ends the waiting call within
LOOPLINE_DB_DEAD_PEER_S, as an outage loopline retries, instead of blocking it forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from loopline.store.db import make_engine
from loopline.store.errors import is_outage
from tests.fakes.cuttable_proxy import CuttableProxy


def _through(proxy: CuttableProxy, database_url: str) -> str:
    return make_url(database_url).set(port=proxy.port).render_as_string(hide_password=False)


def _backends(db, port: int) -> int:
    """Server backends whose client is the proxy's upstream side (any, since only the proxy connects that way)."""
    rows = db.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"), {"a": f"proxy-{port}"}).scalar_one()
    db.rollback()
    return rows


def _call_in_thread(fn) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        started = time.monotonic()
        try:
            outcome["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test reads what it was
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_cut_ends_both_sides_of_every_connection_then_the_server_is_back(database_url, db):
    proxy = CuttableProxy(make_url(database_url).host, make_url(database_url).port or 5432)
    engine = make_engine(_through(proxy, database_url), connect_args={"application_name": f"proxy-{proxy.port}"})
    try:
        held = engine.connect()
        held.execute(sa.text("BEGIN"))
        held.execute(sa.text("SELECT 1"))  # a transaction open on the server: it must end with the cut
        thread, outcome = _call_in_thread(lambda: engine.connect().execute(sa.text("SELECT pg_sleep(30)")).scalar())
        deadline = time.monotonic() + 10
        while _backends(db, proxy.port) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        proxy.cut(8)
        thread.join(5)
        assert not thread.is_alive(), "a call in flight kept waiting after the cut"
        assert is_outage(outcome["error"]), outcome
        with pytest.raises(sa.exc.OperationalError):  # refused while down
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        deadline = time.monotonic() + 5  # (each relaying thread closes its pair when it next runs: later on a loaded CI)
        while proxy.connections() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.connections() == 0
        # the server ends both backends: the idle one in its transaction at once, the sleeping one within
        # client_connection_check_interval (5 s) instead of when its 30 s statement ends
        deadline = time.monotonic() + 15
        while _backends(db, proxy.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _backends(db, proxy.port) == 0, "the server kept a backend of a cut connection"
        time.sleep(max(0.0, proxy.down_until - time.monotonic()))
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        held.invalidate()
        engine.dispose()


def _dropping(port: int):
    """iptables rules that silently drop every packet to and from `port` on this host (a partition)."""
    rules = [["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"], ["INPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"]]

    class Rules:
        def __enter__(self):
            for rule in rules:
                subprocess.run(["iptables", "-I", *rule], check=True)

        def __exit__(self, *exc):
            for rule in rules:
                subprocess.run(["iptables", "-D", *rule], check=False)

    return Rules()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("iptables"), reason="a silent partition needs iptables as root")
@pytest.mark.parametrize("while_", ["sending", "waiting"])
def test_a_silently_dropped_connection_ends_the_call_as_an_outage_within_the_dead_peer_time(while_, database_url, db, monkeypatch):
    """`sending`: the query is never acknowledged (tcp_user_timeout); `waiting`: the query was delivered and the
    answer never comes (keepalives). Without the settings each call waited for ~15 min of TCP retransmissions
    (sending) or forever (waiting)."""
    monkeypatch.setenv("LOOPLINE_DB_DEAD_PEER_S", "4")
    proxy = CuttableProxy(make_url(database_url).host, make_url(database_url).port or 5432)
    engine = make_engine(_through(proxy, database_url), connect_args={"application_name": f"proxy-{proxy.port}"})
    conn = engine.connect()
    conn.execute(sa.text("SELECT 1"))
    partition = _dropping(proxy.port)
    try:
        if while_ == "sending":
            partition.__enter__()
            thread, outcome = _call_in_thread(lambda: conn.execute(sa.text("SELECT 1")).scalar())
        else:
            thread, outcome = _call_in_thread(lambda: conn.execute(sa.text("SELECT 1 FROM pg_sleep(3)")).scalar())
            deadline = time.monotonic() + 10
            while not _active(db, proxy.port) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _active(db, proxy.port), "the query never reached the server"
            partition.__enter__()
        thread.join(60)
        assert not thread.is_alive(), "the call still waits on a connection that went silent 60 s ago"
    finally:
        partition.__exit__()
        conn.invalidate()
        engine.dispose()
    assert "error" in outcome and is_outage(outcome["error"]), outcome
    assert outcome["seconds"] < 30, outcome


def _active(db, port: int) -> bool:
    found = db.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a AND state = 'active'"),
                       {"a": f"proxy-{port}"}).scalar_one()
    db.rollback()
    return found > 0
