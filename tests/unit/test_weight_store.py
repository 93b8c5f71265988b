"""Weights by URI: what a host that does not share the trainer's disk gets, and what it refuses.

The trainer's weight server runs for real here (uvicorn on loopback). "Another host" is a store whose in-place
read is switched off (`elsewhere`): on one machine the trainer's directory is always visible; the container
test (tests/integration/test_hosts.py) runs the same fetch on hosts with filesystems of their own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from loopline.rollout.weights import store as weight_store
from loopline.rollout.weights.server import WeightServer
from loopline.rollout.weights.store import WeightStore, WeightsUnavailable, digest_of, manifest
from loopline.store.uris import WeightsURI


def _model(directory: Path, size: int = 3_000_000) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(os.urandom(size))
    (directory / "tokenizer.json").write_text("{}")
    return directory


@pytest.fixture
def server():
    served = WeightServer("127.0.0.1").start()
    yield served
    served.stop()


def _trainer(tmp_path: Path, server: WeightServer) -> WeightStore:
    return WeightStore("run-a", tmp_path / "trainer-cache", lambda run: (server.url, server.token), serve=server.allow)


def _elsewhere(tmp_path: Path, lookup, deadline_s: float = 45.0) -> WeightStore:
    store = WeightStore("run-a", tmp_path / "host-b-cache", lookup, fetch_deadline_s=deadline_s)
    store._in_place = lambda path, digest: False  # another host: the trainer's path is not on its disk
    return store


def _partly_fetched(tmp_path: Path, uri: str, first_bytes: bytes) -> Path:
    """Host B's unfinished download of `uri`: its weights file holds `first_bytes`."""
    u = WeightsURI.parse(uri)
    partial = tmp_path / "host-b-cache" / "run-a" / f".{u.name}-{u.digest[:16]}.partial"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(first_bytes)
    return partial


def _same_files(a: Path, b: Path) -> bool:
    return all((a / name).read_bytes() == (b / name).read_bytes() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def test_the_digest_covers_every_byte_and_every_name_and_skips_hidden_files(tmp_path):
    model = _model(tmp_path / "m", size=1000)
    before = digest_of(model)
    (model / ".complete").write_text("x")  # (the cache's own marker is not content)
    assert digest_of(model) == before
    data = bytearray((model / "model.safetensors").read_bytes())
    data[500] ^= 1
    (model / "model.safetensors").write_bytes(bytes(data))
    assert digest_of(model) != before
    (model / "model.safetensors").write_bytes(bytes(data))
    (model / "tokenizer.json").rename(model / "tokenizer2.json")
    assert b"tokenizer2.json" in manifest(model)


@pytest.mark.parametrize("uri", [
    "trainer://run-a/data/home/runs/run-a/weights/v000001.77#sha256=" + "ab" * 32,
    "trainer://run.b/a dir/with spaces#sha256=" + "cd" * 32,
    "file:///mnt/shared/run-a/v000001-abcdef#sha256=" + "ef" * 32,
    "s3://bucket/prefix/run-a/v000001-abcdef#sha256=" + "01" * 32,
    "/data/home/runs/run-a/weights/v000001.77",
])
def test_a_uri_reads_back_as_written(uri):
    parsed = WeightsURI.parse(uri)
    assert str(parsed) == uri.replace("a dir/with spaces", "a%20dir/with%20spaces")
    assert WeightsURI.parse(str(parsed)) == parsed


def test_a_host_without_the_trainers_disk_fetches_a_version_checks_it_and_then_needs_no_server(tmp_path, server):
    model = _model(tmp_path / "trainer" / "v000001.1")
    uri = _trainer(tmp_path, server).publish(model)
    assert uri.startswith("trainer://run-a/") and uri.endswith("#sha256=" + digest_of(model))
    host = _elsewhere(tmp_path, lambda run: (server.url, server.token))
    fetched = host.local(uri)
    assert fetched.is_relative_to(tmp_path / "host-b-cache" / "run-a") and _same_files(model, fetched)
    server.stop()  # (cached: the trainer may be gone)
    assert host.local(uri) == fetched


def test_a_cut_download_resumes_from_the_bytes_already_there(tmp_path, server):
    model = _model(tmp_path / "trainer" / "v000002.1")
    uri = _trainer(tmp_path, server).publish(model)
    host = _elsewhere(tmp_path, lambda run: (server.url, server.token))
    _partly_fetched(tmp_path, uri, (model / "model.safetensors").read_bytes()[:1_500_000])  # what a cut connection left
    assert _same_files(model, host.local(uri))


def test_bytes_that_differ_from_the_ledgers_digest_are_refused_and_not_kept(tmp_path, server):
    model = _model(tmp_path / "trainer" / "v000003.1")
    uri = _trainer(tmp_path, server).publish(model)
    host = _elsewhere(tmp_path, lambda run: (server.url, server.token))
    partial = _partly_fetched(tmp_path, uri, os.urandom(1_500_000))  # a corrupt partial file is resumed as it is
    with pytest.raises(WeightsUnavailable, match=r"trainer://run-a/.*the ledger recorded .*refused"):
        host.local(uri)
    assert not partial.exists()
    assert _same_files(model, host.local(uri))  # (the next try starts clean)


def test_the_server_hands_out_only_what_the_run_published_and_only_with_the_token(tmp_path, server):
    model = _model(tmp_path / "trainer" / "v000004.1")
    _trainer(tmp_path, server).publish(model)
    secret = tmp_path / "trainer" / "secret"
    secret.mkdir()
    (secret / "key").write_text("not yours")
    with httpx.Client(base_url=server.url) as client:
        auth = {"Authorization": f"Bearer {server.token}"}
        assert client.get("/manifest", params={"path": str(model)}).status_code == 401
        assert client.get("/manifest", params={"path": str(model)}, headers={"Authorization": "Bearer guess"}).status_code == 401
        assert client.get("/manifest", params={"path": str(model)}, headers=auth).status_code == 200
        assert client.get("/manifest", params={"path": str(secret)}, headers=auth).status_code == 404
        for name in ("../secret/key", "/etc/passwd", "config.json/../../secret/key"):
            assert client.get("/file", params={"path": str(model), "name": name}, headers=auth).status_code == 404
        part = client.get("/file", params={"path": str(model), "name": "model.safetensors"}, headers={**auth, "Range": "bytes=10-19"})
        assert part.status_code == 206 and part.content == (model / "model.safetensors").read_bytes()[10:20]


def test_a_trainer_out_of_reach_is_one_line_naming_the_uri_within_the_deadline(tmp_path, server):
    model = _model(tmp_path / "trainer" / "v000005.1", size=1000)
    uri = _trainer(tmp_path, server).publish(model)
    url = server.url
    server.stop()
    host = _elsewhere(tmp_path, lambda run: (url, "t"), deadline_s=2)
    started = time.monotonic()
    with pytest.raises(WeightsUnavailable) as failed:
        host.local(uri)
    assert time.monotonic() - started < 10
    line = str(failed.value)
    assert "\n" not in line and uri in line and url in line and "is the run's trainer running" in line
    no_server = _elsewhere(tmp_path, lambda run: None, deadline_s=1)
    with pytest.raises(WeightsUnavailable, match="has no weight server in the ledger"):
        no_server.local(uri)


def test_a_restarted_trainer_is_found_again_through_the_ledger(tmp_path, server):
    model = _model(tmp_path / "trainer" / "v000006.1", size=1000)
    uri = _trainer(tmp_path, server).publish(model)
    old_url = server.url
    server.stop()
    restarted = WeightServer("127.0.0.1").start()  # a new port and a new token
    restarted.allow(model)
    answers = iter([(old_url, "old token"), (old_url, "old token")])
    try:
        host = _elsewhere(tmp_path, lambda run: next(answers, (restarted.url, restarted.token)), deadline_s=20)
        assert _same_files(model, host.local(uri))
    finally:
        restarted.stop()


def test_a_version_the_trainer_does_not_serve_fails_at_once(tmp_path, server):
    model = _model(tmp_path / "trainer" / "v000007.1", size=1000)
    uri = WeightStore("run-a", tmp_path / "c").publish(model)  # (published, but never handed to the server)
    host = _elsewhere(tmp_path, lambda run: (server.url, server.token), deadline_s=30)
    started = time.monotonic()
    with pytest.raises(WeightsUnavailable, match="does not serve it"):
        host.local(uri)
    assert time.monotonic() - started < 5


def test_a_shared_filesystem_store_copies_once_and_reads_in_place(tmp_path):
    model = _model(tmp_path / "trainer" / "v000001.1", size=1000)
    shared = tmp_path / "shared"
    store = WeightStore("run-a", tmp_path / "c", store=f"file://{shared}")
    uri = store.publish(model)
    u = WeightsURI.parse(uri)
    assert u.scheme == "file" and Path(u.path).is_relative_to(shared / "run-a") and store.publish(model) == uri
    other = WeightStore("run-a", tmp_path / "c2")
    assert other.local(uri) == Path(u.path)
    (Path(u.path) / "config.json").write_text("{}")  # changed on the share after it was published
    weight_store._checked.clear()  # (another process: it has checked nothing yet)
    with pytest.raises(WeightsUnavailable, match="not on this host with that content"):
        WeightStore("run-a", tmp_path / "c3").local(uri)


def test_an_object_store_through_fsspec_uploads_once_and_each_host_downloads_and_checks(tmp_path):
    import fsspec

    model = _model(tmp_path / "trainer" / "v000001.1", size=10_000)
    store = WeightStore("run-a", tmp_path / "c", store="memory://bucket/loopline")
    uri = store.publish(model)
    assert uri.startswith("memory://bucket/loopline/run-a/v000001.1-")
    fetched = WeightStore("run-a", tmp_path / "host-b").local(uri)
    assert _same_files(model, fetched)
    fs = fsspec.filesystem("memory")
    remote = WeightsURI.parse(uri).path.removeprefix("memory://")
    fs.pipe(f"{remote}/config.json", b"{}")  # the object changed after it was published
    with pytest.raises(WeightsUnavailable, match="refused"):
        WeightStore("run-a", tmp_path / "host-c").local(uri)


def test_the_cache_keeps_v0_what_is_served_and_the_newest_and_drops_the_rest(tmp_path, server):
    trainer = _trainer(tmp_path, server)
    host = _elsewhere(tmp_path, lambda run: (server.url, server.token))
    uris = [trainer.publish(_model(tmp_path / "trainer" / f"v{v:06d}.1", size=1000)) for v in range(5)]
    host.pinned.add(uris[0])
    fetched = [host.local(uri) for uri in uris]
    old = time.time() - 3600
    for i, path in enumerate(fetched):  # (each fetched an hour ago, in order)
        os.utime(path, (old + i, old + i))
    removed = host.evict({uris[2]})
    assert sorted(removed) == sorted([fetched[1]])  # v0 pinned, v2 served, v3 and v4 the newest two
    everything = WeightStore("run-a", tmp_path / "host-b-cache", keep=0)
    everything.pinned.add(uris[0])
    os.utime(fetched[3], None)  # (used just now: another process of this host may be loading it)
    assert sorted(everything.evict(set())) == sorted([fetched[2], fetched[4]])
    assert fetched[0].is_dir() and fetched[3].is_dir()
