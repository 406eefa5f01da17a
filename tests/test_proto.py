"""The generated protobuf/gRPC modules are importable and in sync with proto/expert.proto."""

import importlib.util
from pathlib import Path

from services.rpc import expert_pb2, expert_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def _load_generate():
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_are_fresh(tmp_path):
    generate = _load_generate()
    written = generate.generate(tmp_path)
    assert written, "generate() wrote nothing"
    for path in written:
        committed = REPO / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `make proto`"


def test_contract_shape():
    service = expert_pb2.DESCRIPTOR.services_by_name["Expert"]
    assert service.full_name == "moecluster.expert.v1.Expert"
    assert set(service.methods_by_name) == {"Dispatch", "LoadSlots", "ReleaseSlots", "Stats", "FetchExperts"}
    fetch = service.methods_by_name["FetchExperts"]
    assert fetch.server_streaming and not fetch.client_streaming
    assert "peers" in expert_pb2.LoadSlotsRequest.DESCRIPTOR.fields_by_name
    assert "bytes_from_peers" in expert_pb2.LoadSlotsResponse.DESCRIPTOR.fields_by_name
    fields = expert_pb2.DispatchRequest.DESCRIPTOR.fields_by_name
    assert list(fields) == ["layer", "placement_version", "hidden", "slot", "weight"]
    assert hasattr(expert_pb2_grpc, "ExpertStub")
