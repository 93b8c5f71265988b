"""loopline: agentic RL training with a PostgreSQL ledger."""

import os

# Before torch is imported anywhere: with busy-waiting OpenMP threads a shared 2-core CPU ran decode
# steps 20-40x slower (measured on 2 shared cores with 2 torch threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A flow called from Python (no server configured) starts Prefect's temporary server and gives it 20 s to
# answer; on a busy 2-core machine it took longer (the resume-under-load test's replays failed so). The CLI
# waits 120 s for its own; so does this, unless set. (Read when Prefect is imported: set before that.)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
