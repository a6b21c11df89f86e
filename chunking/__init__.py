"""Strata chunking package."""
