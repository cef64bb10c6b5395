"""Variation-aware power management under a machine power bound (Seed 004): power-IPS curves,
PTune (a job's processors and caps) and PPartition (the machine's budget across jobs)."""
