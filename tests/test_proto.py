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
    methods = {"Dispatch", "DispatchStream", "LoadSlots", "ReleaseSlots", "Stats", "FetchExperts"}
    assert set(service.methods_by_name) == methods
    fetch = service.methods_by_name["FetchExperts"]
    assert fetch.server_streaming and not fetch.client_streaming
    stream = service.methods_by_name["DispatchStream"]
    assert stream.server_streaming and stream.client_streaming
    # a successful stream answer is a DispatchResponse's bytes: the same field numbers
    answer = expert_pb2.DispatchStreamResponse.DESCRIPTOR.fields_by_name
    for name, f in expert_pb2.DispatchResponse.DESCRIPTOR.fields_by_name.items():
        assert (answer[name].number, answer[name].type) == (f.number, f.type)
    assert "peers" in expert_pb2.LoadSlotsRequest.DESCRIPTOR.fields_by_name
    assert "bytes_from_peers" in expert_pb2.LoadSlotsResponse.DESCRIPTOR.fields_by_name
    fields = expert_pb2.DispatchRequest.DESCRIPTOR.fields_by_name
    assert list(fields) == ["layer", "placement_version", "hidden", "slot", "weight"]
    assert hasattr(expert_pb2_grpc, "ExpertStub")
