"""The form of a published directory's URI, as the ledger records it (`policy_version.weights_uri`, `adapter_uri`):
`SCHEME://...#sha256=HEX` (pip's form), the digest being the sha256 of the directory's manifest. How each scheme
is published and fetched is `rollout/weights/store.py`; this is only the syntax, which the ledger's readers (the
inspector, the cleanup of a trainer's own files) need too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

TRAINER = "trainer"  # the default store: the run's trainer serves what it wrote


@dataclass(frozen=True)
class WeightsURI:
    scheme: str  # "" for a bare path
    run: str  # trainer://: the run whose trainer serves it
    path: str  # trainer:// and file://: the directory on the publishing host; others: the URI without its digest
    digest: str | None

    @classmethod
    def parse(cls, uri: str) -> "WeightsURI":
        body, _, fragment = uri.partition("#")
        digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
        if "://" not in body:
            return cls("", "", body, digest)
        parts = urlsplit(body)
        if parts.scheme == TRAINER:
            return cls(TRAINER, parts.netloc, unquote(parts.path), digest)
        if parts.scheme == "file":
            return cls("file", "", unquote(parts.path), digest)
        return cls(parts.scheme, "", body, digest)

    def __str__(self) -> str:
        tail = f"#sha256={self.digest}" if self.digest else ""
        if self.scheme == TRAINER:
            return f"{TRAINER}://{self.run}{quote(self.path)}{tail}"
        if self.scheme == "file":
            return f"file://{quote(self.path)}{tail}"
        return f"{self.path}{tail}"

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


    def on_this_host(self) -> bool:
        """Whether the directory is where it was published, on this host (a trainer's own files; a shared mount)."""
        return self.scheme in ("", TRAINER, "file") and Path(self.path).is_dir()


def path_on_publisher(uri: str) -> str:
    """Where the publishing host keeps the directory a URI names (the trainer's own files, for its cleanup)."""
    return WeightsURI.parse(uri).path
