"""Strata deploy package."""
