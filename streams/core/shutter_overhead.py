"""The shutter's cost to the jobs it pauses (Seed 002, Section 8.1, Eq. 9-10)."""

from __future__ import annotations


def sleep_fraction(n_jobs: int, shutter_s: float, period_s: float) -> float:
    """Eq. 9: Z = (n - 1) * S / (n * (3S + P)), the share of time a job spends paused."""
    if n_jobs < 1:
        raise ValueError("n_jobs must be at least 1")
    return (n_jobs - 1) * shutter_s / (n_jobs * (3 * shutter_s + period_s))


def dilated_run_time(run_time_s: float, n_jobs: int, shutter_s: float, period_s: float) -> float:
    """Eq. 10: T(S, P) = T / (1 - Z) = T * n (3S + P) / (2nS + nP + S)."""
    return run_time_s / (1.0 - sleep_fraction(n_jobs, shutter_s, period_s))
