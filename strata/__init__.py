"""Strata: a distributed multilevel-secure data stream management system."""

__version__ = "0.1.0"
