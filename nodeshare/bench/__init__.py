"""Benchmarks, one home: each runs real code on generated or simulated input, prints its numbers
and writes them to a JSON file (``nodeshare bench ...``) in one shape (``result``: name, date,
machine, targets and whether each was met, then the figures). Speed goals are
met here, never in timed unit tests.

* ``audit``: the vectorized audit against a plain scan, and as Dask tasks per partition;
* ``ledger``: shutter windows counted into the ledger's co-runner table;
* ``stream``: blocks through one stream worker, and job end to durable charge latency;
* ``agent``: the node agent's CPU and its co-runners' dilation (Eq. 9-10) on real processes.

The placement and power benchmarks time the papers' algorithms and live beside their
experiments (``nodeshare.experiments.pairing``, ``nodeshare.experiments.power``).
"""
