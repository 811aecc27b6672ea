"""Metrics, in one place, through Ray's metrics API (exported by Ray's Prometheus endpoint,
with Ray's ``ray_`` prefix). Tags are low-cardinality: replica ids (a handful), states, methods;
never request ids."""
