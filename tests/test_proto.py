"""The committed generated gRPC code matches strata.proto."""

from strata.rpc import codegen, strata_pb2


def test_generated_code_is_current():
    assert codegen.main(["--check"]) == 0


def test_messages_import():
    assert strata_pb2.ExecuteRequest(level="S").level == "S"
