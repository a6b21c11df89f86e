"""Strata master package."""
