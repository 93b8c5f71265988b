"""The ledger's operations, one transaction each; the only writes the pipeline makes.

Every function takes a `Session`, does its work in one transaction and commits (or rolls back and
raises). Exactly-once rests on three things:

- claims use `FOR UPDATE SKIP LOCKED`, so concurrent workers never share a slot;
- uniqueness lives in the database (one trajectory per slot, one consumption per trajectory,
  consumption only of train trajectories);
- a learner step's consumption, new policy version and checkpoint (when one was written) are written in a single
  transaction, and the groups it trains are recorded before training, so a retry trains exactly
  the same set.

By concern: `runs` (lifecycle, fencing, liveness), `versions` (weights, exports, evaluations, servers),
`resume` (where a run stands), `slots` (plans, claims, leases, attempts), `commits` (trajectories in and
out), `learning` (groups, learner batches, consumption).
This module is the one name callers use for all of them.
"""

from __future__ import annotations

from loopline.store.runs import (
    config_hash,
    create_run,
    delete_run,
    end_run,
    get_run,
    heartbeat,
    mark_abandoned,
    request_cancel,
    require_driver,
    restate_config,
    set_run_plan,
    start_run,
)
from loopline.store.versions import (
    VersionWeights,
    exported_versions,
    initial_weights,
    latest_policy_version,
    mark_published,
    named_files,
    owed_evaluations,
    published_uris,
    rebuilt_digests,
    record_eval_result,
    record_export,
    record_rebuild,
    record_served,
    record_weight_server,
    release_servers,
    serving_servers,
    version_weights,
    weight_server,
)
from loopline.store.resume import consumed_trajectory_ids, resume_state
from loopline.store.slots import (
    claim_slots,
    expire_leases,
    fail_attempt,
    group_id_for,
    lease_holders,
    plan_step,
    release_attempt,
    renew_leases,
    slot_id_for,
    unfinished_slots,
)
from loopline.store.commits import (
    BulkMethod,
    commit_trajectories,
    commit_trajectory,
    load_chained,
    load_trajectories,
    rollout_metrics,
)
from loopline.store.prompts import whole_prompts
from loopline.store.learning import (
    claim_learner_batch,
    first_refusal,
    last_infra_failure,
    commit_learner_step,
    complete_groups,
    group_states,
    open_groups_through,
    record_refused_step,
    trained_batch,
    trained_threads,
)

__all__ = [
    "start_run",
    "request_cancel",
    "mark_abandoned",
    "heartbeat",
    "require_driver",
    "restate_config",
    "end_run",
    "delete_run",
    "BulkMethod",
    "VersionWeights",
    "claim_learner_batch",
    "first_refusal",
    "last_infra_failure",
    "claim_slots",
    "commit_learner_step",
    "commit_trajectories",
    "commit_trajectory",
    "complete_groups",
    "config_hash",
    "consumed_trajectory_ids",
    "create_run",
    "expire_leases",
    "exported_versions",
    "named_files",
    "published_uris",
    "record_weight_server",
    "weight_server",
    "fail_attempt",
    "get_run",
    "group_id_for",
    "group_states",
    "initial_weights",
    "latest_policy_version",
    "lease_holders",
    "whole_prompts",
    "load_chained",
    "load_trajectories",
    "rollout_metrics",
    "mark_published",
    "open_groups_through",
    "record_refused_step",
    "trained_batch",
    "trained_threads",
    "owed_evaluations",
    "plan_step",
    "record_eval_result",
    "rebuilt_digests",
    "record_export",
    "record_rebuild",
    "record_served",
    "release_attempt",
    "release_servers",
    "renew_leases",
    "resume_state",
    "serving_servers",
    "set_run_plan",
    "slot_id_for",
    "unfinished_slots",
    "version_weights",
]
