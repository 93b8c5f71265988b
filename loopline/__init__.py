"""loopline: agentic RL training with a PostgreSQL ledger."""

import os

# Before torch is imported anywhere: with busy-waiting OpenMP threads a shared 2-core CPU ran decode
# steps 20-40x slower (measured on 2 shared cores with 2 torch threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A resume and `loopline replay` rebuild a version's weights bit for bit on CPU. oneMKL (torch's CPU BLAS)
# promises run-to-run reproducibility only with a fixed thread count that it may not adjust at run time:
# MKL_DYNAMIC and OMP_DYNAMIC false (its "Reproducibility Conditions"; MKL_DYNAMIC defaults to true).
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("OMP_DYNAMIC", "FALSE")

# A flow called from Python (no server configured) starts Prefect's temporary server and gives it 20 s to
# answer; on a busy 2-core machine it took longer (the resume-under-load test's replays failed so). The CLI
# waits 120 s for its own; so does this, unless set. (Read when Prefect is imported: set before that.)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
