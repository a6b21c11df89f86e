"""The example deployments (also in examples/*.toml): battlefield (ch. 4, §9.2) and cloud audit (ch. 8)."""

BATTLEFIELD_TOML = """\
# Battlefield monitoring (dissertation ch. 4 and §9.2): four levels, two streams.
[lattice]
levels = ["U", "C", "S", "TS"]

[streams.Vitals]
sid = "string"
bp = "double"
pr = "double"
weight = "double"

[streams.Positions]
sid = "string"
lat = "double"
lon = "string"
"""

AUDIT_TOML = """\
# Cloud audit (dissertation ch. 8): Chinese Wall lattice, COI {1,2} and {A,B,C}.
[lattice]
coi = [["1", "2"], ["A", "B", "C"]]

[streams.MessageLog]
serviceId = "string"
msgType = "string"
sender = "string"
receiver = "string"
timestamp = "long"
outcome = "string"
"""
