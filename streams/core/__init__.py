"""The pure core: every formula of the papers as functions and folds over typed events, with no
runtime (no faust, Kafka client, DuckDB or file I/O). The worker, the sinks, the audits, the
agent and the experiments all call these same functions: accounting (the charge fold), blocks,
degradation (Eq. 1-4, Alg. 4), pricing, shutter_overhead (Eq. 9-10), profiles, pairing
(Seed 003), placement (Spread-n-Share and the placement fold) and power (PTune, PPartition)."""
