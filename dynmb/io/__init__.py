"""Atomic writes, tidy result tables (CSV, Parquet), output folders and their lock, host facts."""
