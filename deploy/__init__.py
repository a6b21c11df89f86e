"""Strata deploy package: multi-host deployment of level groups.

``inventory`` (parse/validate the inventory TOML), ``units`` (command lines,
environments, systemd units, which secrets go to which host), ``remote``
(ssh/netns/local transports and the host agent), ``cli`` (``strata deploy``).
See ``docs/deploy.md``.
"""
