"""Pure-Python planning: the Plan contract (``planner.contract``), and above it the cost model,
sharding, offload policy, balance scheduler and stage-order search that produce plans.

Nothing is imported here, so that loading the contract does not load the schedulers."""
