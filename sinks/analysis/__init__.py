"""What analysts and operators read from the stores and the bus: usage queries over the ledger
(usage.py), the report's plots (report.py), and inspection of topics and dead letters
(inspect.py). Nothing here writes a store; the sinks do."""
