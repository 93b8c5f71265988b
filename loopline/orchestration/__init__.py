"""Around the flows: the Prefect server loopline starts, the deployments and work pools it registers, and the
entry point of a launched learner rank (which runs the train flow)."""
