"""The workers: their state (``workers``), the policies and routing that pick pairs, health checks, reconciliation
with the engines and the lineage of earlier gateway processes."""
