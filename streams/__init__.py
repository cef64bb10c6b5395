"""Stream processors: faust agents that are thin shells over pure functions."""
