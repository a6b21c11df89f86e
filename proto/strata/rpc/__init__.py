"""Strata rpc package."""
