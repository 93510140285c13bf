"""Whole jobs built from the layers above: ``dynmb compare`` (fixed against dynamic, real runs)."""
