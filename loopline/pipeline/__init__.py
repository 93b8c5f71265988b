"""The loop's plain code, without Prefect: its stages (plan, rollout, learn, sync, evaluate), the learner's side of a
training process, a run's assembly from its config, policies and the tiny starter, checks before launch, the
trackers, and the launcher of a learner's ranks. `tasks/` wraps the stages as Prefect tasks; `flows/` runs them."""
