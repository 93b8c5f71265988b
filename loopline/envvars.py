"""Every `LOOPLINE_*` environment variable, with what it does: the docs' environment-variable reference is
written from these tables, and a test finds every such name in the source and fails on one missing here
(or listed here and read nowhere), so the page cannot fall behind the code."""

from __future__ import annotations

# What a user (or a deployment) sets; each is read where the code names it.
SETTINGS: dict[str, str] = {
    "LOOPLINE_HOME": "Where loopline keeps what outlives a process: the embedded PostgreSQL, runs' logs, checkpoints and "
    "weights, models. Default `~/.loopline`.",
    "LOOPLINE_DATABASE_URL": "The ledger's PostgreSQL (`postgresql://user@host:port/db`); unset: an embedded server under "
    "`LOOPLINE_HOME`. Every host of a run sets the same URL.",
    "LOOPLINE_IMPORTS": "Comma-separated Python modules every loopline command imports first (registering your "
    "components), added to a run config's and an env spec's `imports:`.",
    "LOOPLINE_DEBUG": "Set (to anything): errors are printed with their tracebacks instead of one line.",
    "LOOPLINE_RETRY_S": "How long a database outage or a restarting server is waited out before a run stops (resumable). "
    "Default 60 s.",
    "LOOPLINE_DB_IDLE_IN_TRANSACTION_S": "The ledger ends a transaction idle this long (a frozen client holding locks). "
    "Default 30 s; 0: no limit.",
    "LOOPLINE_DB_LOCK_TIMEOUT_S": "The longest a ledger statement waits for a lock before it fails (retried). Default 120 s; "
    "0: no limit.",
    "LOOPLINE_DB_STATEMENT_TIMEOUT_S": "The longest one ledger statement may run. Default 900 s; 0: no limit.",
    "LOOPLINE_DB_CLIENT_CHECK_S": "How often the ledger checks, during a statement, that its client is still there. "
    "Default 5 s; 0: never.",
    "LOOPLINE_DB_DEAD_PEER_S": "A ledger connection silent this long (its host died, its network dropped) is closed and "
    "the call retried (TCP keepalives). Default 30 s; 0: the operating system's defaults (hours).",
    "LOOPLINE_ENVREG_TIMEOUT": "The longest `envreg` may spend reading an env spec and its task files. Default 60 s.",
    "LOOPLINE_AGENT_ENDPOINT_LISTEN": "E2B agent programs: `HOST:PORT` where the model endpoint listens for the cloud "
    "sandboxes (behind your TLS proxy or tunnel).",
    "LOOPLINE_AGENT_ENDPOINT_URL": "E2B agent programs: the public URL at which the cloud sandboxes reach that endpoint.",
    "LOOPLINE_TEMP_SERVER": "`prefect`: leave the temporary Prefect server to Prefect's own (for comparisons; loopline's "
    "starts faster and stops with the command).",
    "LOOPLINE_FAILPOINT": "Tests only: `NAME[:N[:hang]]` kills (or hangs) the process the N-th time it passes the named "
    "place, to prove that every crash resumes exactly once (`loopline/failpoints.py` lists the names).",
}

# What loopline sets for the programs an environment runs (verifiers, agents) and for its own child processes.
PROVIDED: dict[str, str] = {
    "LOOPLINE_WORKDIR": "A command verifier: the directory holding the agent's files.",
    "LOOPLINE_VERIFY_DIR": "A command verifier: its private directory (also its HOME and TMPDIR), which the agent never "
    "touched.",
    "LOOPLINE_ANSWER_FILE": "A command verifier: the file holding the agent's final message (`answer.txt` in its private "
    "directory).",
    "LOOPLINE_VERDICT_FILE": "A command verifier: where it writes its verdict, JSON: `{\"passed\": P, \"total\": T}` or "
    "`{\"reward\": R}` (stdout is never read as one).",
    "LOOPLINE_AGENT_EXEC": "A command verifier: a JSON argv prefix that runs a command as the agent's user (code the "
    "agent wrote must only run through it).",
    "LOOPLINE_TASK_FILE": "An agent program: the JSON file holding its task (`id`, `system_prompt`, `prompt`).",
    "LOOPLINE_LEARNER_RANK_OF": "A learner rank: the process that launched it (a rank never launches ranks itself).",
}
