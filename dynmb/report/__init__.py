"""Summaries, comparison tables and plots of the tidy results tables."""
