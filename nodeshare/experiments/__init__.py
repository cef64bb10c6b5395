"""Experiments and benchmarks behind ``nodeshare experiment`` and ``nodeshare bench``: each returns
a JSON-able dict of what it measured and can draw it as a PNG."""
