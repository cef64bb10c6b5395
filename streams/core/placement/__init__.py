"""Placement: Spread-n-Share (sns) and the placement manager that folds the cluster log (stream)."""
