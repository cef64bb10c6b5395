"""Stream processing: ``core`` (pure functions and folds) and ``worker`` (the faust shell that runs them)."""
