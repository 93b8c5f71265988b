"""loopline: agentic RL training with a PostgreSQL ledger."""

import os

# Before torch is imported anywhere: with busy-waiting OpenMP threads a shared 2-core CPU ran decode
# steps 20-40x slower (shared/notes/platform.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
