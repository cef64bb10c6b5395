"""What reads results out: the DuckDB ledger, the Parquet archive and the audit."""
