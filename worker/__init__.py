"""Strata worker package."""
