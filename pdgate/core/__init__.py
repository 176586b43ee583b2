"""The pure core: errors, wire constants, the request record, ids, the queue's order, the learned
limit, configuration, validation and deadlines. No I/O, no imports from the layers above (``docs/architecture.md``,
"Parts")."""
