"""Weights addressed by URI: how a version (v0, full weights, a LoRA adapter) reaches a host that shares no disk
with the trainer.

Every directory a run publishes gets a URI with its digest in pip's form, `SCHEME://...#sha256=HEX`, where the
digest is the sha256 of its manifest (each file's name, size and sha256). The ledger keeps the URI; any process,
on any host, turns it into a local directory with `WeightStore.local`, which checks the digest before anything
loads it. The schemes (`weights.store` in the run config picks the one the trainer publishes to):

- `trainer://RUN/ABS/PATH`: the default. The directory stays where the learner wrote it; the run's trainer
  serves it over HTTP (`weight_server.py`: its address and a per-run token are in the ledger). A host where the
  same path holds the same bytes (the trainer's own, or one sharing LOOPLINE_HOME) reads it in place; any other
  downloads it into its cache.
- `file:///SHARED/DIR/RUN/NAME`: a filesystem every host mounts at the same path; copied there once, read in place.
- any other scheme fsspec knows (`s3://`, `gs://`, `az://`, ...): an object store; uploaded once, downloaded
  into each host's cache. Needs fsspec and the scheme's package (s3fs, gcsfs, ...) on every host.
- a bare path (runs recorded before URIs): read in place, unchecked.

The cache (LOOPLINE_HOME/cache/weights/RUN/) holds one directory per published one, named by its digest.
Downloads resume file by file after a cut; two processes on one host fetch a version once (a file lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx

from loopline.errors import LooplineError
from loopline.store import db as store_db
from loopline.store.uris import TRAINER, WeightsURI

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


class WeightsUnavailable(LooplineError):
    """A published version that this host cannot get or that is not what the ledger recorded."""


# --------------------------------------------------------------------------------------------- manifests


def manifest(directory: Path) -> bytes:
    """The directory's content, canonically: each regular file (links followed, hidden files skipped) by its
    path, size and sha256. Its sha256 is the digest a URI carries. The files are hashed on several threads
    (hashlib releases the GIL): a sharded 7B export is ~15 GB."""
    files = sorted(
        p for p in directory.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(_file_sha256, files))
    listed = [
        {"name": path.relative_to(directory).as_posix(), "size": path.stat().st_size, "sha256": digest} for path, digest in zip(files, digests)
    ]
    return json.dumps({"files": listed}, sort_keys=True, separators=(",", ":")).encode()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def digest_of(directory: Path) -> str:
    return hashlib.sha256(manifest(directory)).hexdigest()


# --------------------------------------------------------------------------------------------- the store


# Directories this process wrote or checked against a digest (path -> digest): an export is never rewritten, so
# one check per process is enough (a model's files are hashed once, not at every load).
_checked: dict[Path, str] = {}
_checked_lock = threading.Lock()

def _remember(path: Path, digest: str) -> None:
    with _checked_lock:
        _checked[path] = digest


ServerLookup = Callable[[str], "tuple[str, str] | None"]  # run name -> (url, token) of its weight server, from the ledger


class WeightStore:
    """A process's way to the run's published weights: `publish` on the trainer, `local` everywhere.

    `store`: where the trainer publishes (TRAINER, `file:///dir`, or an fsspec URL); `lookup`: the ledger's
    record of a run's weight server; `serve`: the trainer's server, told of each directory it may hand out.
    """

    def __init__(
        self, run: str, cache: Path, lookup: ServerLookup | None = None, store: str = TRAINER,
        serve: Callable[[Path], None] | None = None, fetch_deadline_s: float = 45.0, keep: int = 2,
    ):
        self.run, self.cache, self.lookup, self.store, self.serve = run, cache, lookup, store, serve
        self.fetch_deadline_s, self.keep = fetch_deadline_s, keep
        self.pinned: set[str] = set()  # URIs never evicted from the cache (the run's v0: tokenizer, base model)

    @classmethod
    def plain(cls) -> "WeightStore":
        """Reads bare paths and what is in place or cached on this host; fetches nothing from a trainer."""
        return cls("", store_db.loopline_home() / "cache" / "weights")

    # ------------------------------------------------------------------------- publishing (the trainer)

    def publish(self, directory: Path) -> str:
        """The URI other hosts reach `directory` by (it must not change afterwards: exports never do)."""
        directory = Path(directory).resolve()
        digest = digest_of(directory)
        if self.store == TRAINER:
            if self.serve is not None:
                self.serve(directory)
            uri = WeightsURI(TRAINER, self.run, str(directory), digest)
            _remember(directory, digest)
        elif self.store.startswith("file://"):
            target = Path(WeightsURI.parse(self.store).path) / self.run / f"{directory.name}-{digest[:16]}"
            if not target.is_dir():
                _copy_complete(directory, target)
            uri = WeightsURI("file", "", str(target), digest)
            _remember(target, digest)
        else:
            remote = f"{self.store.rstrip('/')}/{self.run}/{directory.name}-{digest[:16]}"
            fs, root = _fsspec(remote)
            if not fs.exists(f"{root}/.complete"):
                fs.put(str(directory), root, recursive=True)
                fs.pipe(f"{root}/.complete", digest.encode())
            uri = WeightsURI(self.store.split("://", 1)[0], "", remote, digest)
        return str(uri)

    # ------------------------------------------------------------------------- getting (any host)

    def local(self, uri: str) -> Path:
        """A local directory holding exactly what `uri` names: in place when this host has it, else fetched
        into the cache. One line (WeightsUnavailable) naming the URI when it cannot be had."""
        u = WeightsURI.parse(uri)
        if not u.scheme:  # recorded before URIs: where it was written, unchecked
            if not Path(u.path).is_dir():
                raise WeightsUnavailable(
                    f"{u.path}: not a directory on this host (the run recorded its weights as a path on the trainer's "
                    "disk, before loopline published them by URI); run this on the trainer's host"
                )
            return Path(u.path)
        if u.scheme in (TRAINER, "file") and self._in_place(Path(u.path), u.digest):
            return Path(u.path)
        if u.scheme == "file":
            raise WeightsUnavailable(f"{uri}: {u.path} is not on this host with that content (weights.store file:// needs the directory mounted at the same path on every host)")
        entry = self.cache / (u.run or self.run) / _entry_name(u)
        if (entry / ".complete").is_file():
            os.utime(entry)
            return entry
        return self._fetch(u, entry)

    def _in_place(self, path: Path, digest: str | None) -> bool:
        with _checked_lock:
            if digest is not None and _checked.get(path) == digest:
                return True
        if not path.is_dir():
            return False
        same = digest is None or digest_of(path) == digest
        if same and digest is not None:
            _remember(path, digest)
        return same

    def _fetch(self, u: WeightsURI, entry: Path) -> Path:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_name(f".{entry.name}.partial")
        with open(entry.with_name(f".{entry.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process of this host may be fetching it: wait, then take its result
            if (entry / ".complete").is_file():
                return entry
            started = time.monotonic()
            partial.mkdir(exist_ok=True)
            if u.scheme == TRAINER:
                self._download(u, partial)
            else:
                fs, root = _fsspec(u.path)
                try:
                    for remote in fs.find(root):
                        name = remote[len(root):].lstrip("/")
                        if name and not name.startswith("."):
                            (partial / name).parent.mkdir(parents=True, exist_ok=True)
                            fs.get_file(remote, str(partial / name))
                except (OSError, ValueError) as exc:
                    raise WeightsUnavailable(f"{u}: {type(exc).__name__}: {exc}") from None
            got = digest_of(partial)
            if u.digest is not None and got != u.digest:
                shutil.rmtree(partial, ignore_errors=True)
                raise WeightsUnavailable(f"{u}: the files fetched have digest {got[:16]}…, the ledger recorded {u.digest[:16]}…; refused")
            (partial / ".complete").write_text(got)
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(partial, entry)
            log.info("fetched %s into %s in %.1f s", u, entry, time.monotonic() - started)
        return entry

    def _download(self, u: WeightsURI, partial: Path) -> None:
        """Every file of the trainer-served directory into `partial`, resuming each from the bytes already there.
        Transient failures (the trainer restarting, a network cut) are retried until `fetch_deadline_s` has passed
        without a byte coming in; the server is looked up in the ledger again before each try (a restarted
        trainer serves on a new address and token)."""
        deadline = time.monotonic() + self.fetch_deadline_s
        why = "no try yet"
        while True:
            had = _bytes_in(partial)
            server = self.lookup(u.run) if self.lookup else None
            if server is None:
                why = f"run {u.run} has no weight server in the ledger (its trainer has not started one)"
            else:
                url, token = server
                try:
                    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=httpx.Timeout(30.0, connect=5.0)) as client:
                        listing = client.get("/manifest", params={"path": u.path})
                        _refuse_final(u, listing)
                        for item in json.loads(listing.content)["files"]:
                            _download_file(client, u.path, item, partial / item["name"])
                    return
                except (httpx.TransportError, _Retry) as exc:
                    why = f"the trainer's weight server at {url}: {type(exc).__name__}: {exc}"
            if _bytes_in(partial) > had:  # (a cut after progress: the deadline counts from here)
                deadline = time.monotonic() + self.fetch_deadline_s
            if time.monotonic() > deadline:
                raise WeightsUnavailable(f"{u}: {why}; tried for {self.fetch_deadline_s:.0f} s (is the run's trainer running and reachable from this host?)")
            time.sleep(1.0)

    def evict(self, keep: set[str]) -> list[Path]:
        """Remove cached directories of the run that no slot can use any more: all but those of `keep` (URIs:
        v0 and what the engine serves), the `keep` newest, and any touched in the last minute (another process
        of this host may be loading it)."""
        root = self.cache / self.run
        if not root.is_dir():
            return []
        kept = {_entry_name(WeightsURI.parse(uri)) for uri in keep | self.pinned}
        entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
        removed = []
        for entry in entries[: -self.keep or None]:
            if entry.name not in kept and time.time() - entry.stat().st_mtime > 60:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        return removed


def _entry_name(u: WeightsURI) -> str:
    return f"{u.name}-{(u.digest or 'unchecked')[:16]}"


class _Retry(Exception):
    """A server answer worth trying again (the trainer restarting: its token changed, or it is busy)."""


def _refuse_final(u: WeightsURI, response: httpx.Response) -> None:
    if response.status_code in (401, 403, 502, 503, 504):
        raise _Retry(f"HTTP {response.status_code}")
    if response.status_code == 404:
        raise WeightsUnavailable(f"{u}: the run's trainer does not serve it ({response.text.strip()}); it was pruned or never published")
    if response.status_code != 200 and response.status_code != 206:
        raise WeightsUnavailable(f"{u}: the trainer's weight server answered HTTP {response.status_code}: {response.text.strip()[:200]}")


def _download_file(client: httpx.Client, directory: str, item: dict, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    have = target.stat().st_size if target.exists() else 0
    if have == item["size"]:
        return
    if have > item["size"]:
        target.unlink()
        have = 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with client.stream("GET", "/file", params={"path": directory, "name": item["name"]}, headers=headers) as response:
        if response.status_code == 416:  # (the file changed under us: start it again)
            target.unlink(missing_ok=True)
            raise _Retry("HTTP 416")
        _refuse_final(WeightsURI(TRAINER, "", directory, None), response)
        mode = "ab" if response.status_code == 206 else "wb"
        with open(target, mode) as f:
            for block in response.iter_bytes(_CHUNK):
                f.write(block)


def _bytes_in(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _copy_complete(source: Path, target: Path) -> None:
    partial = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns(".*"))
    os.replace(partial, target)


def _fsspec(url: str):
    try:
        import fsspec
    except ImportError:
        raise WeightsUnavailable(f"{url}: weights in an object store need fsspec and the store's package: pip install fsspec s3fs (or gcsfs, adlfs)") from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise WeightsUnavailable(f"{url}: {exc}") from None
    return fs, root.rstrip("/")
