"""The checked-in stubs are exactly what grpcio-tools generates from transport/diloco.proto."""

from pathlib import Path

from transport import diloco_pb2, diloco_pb2_grpc
from transport.gen_stubs import GENERATED, PROTO_DIR, generate_stubs


def test_regenerated_stubs_match_checked_in(tmp_path: Path):
    written = generate_stubs(tmp_path)
    assert [p.name for p in written] == list(GENERATED)
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        checked_in = (PROTO_DIR / name).read_text()
        assert fresh == checked_in, f"{name} is stale: run `python -m transport.gen_stubs`"


def test_stubs_import_as_package_and_are_versioned():
    assert diloco_pb2.DESCRIPTOR.package == "diloco.v1"
    service = diloco_pb2.DESCRIPTOR.services_by_name["Diloco"]
    assert sorted(m.name for m in service.methods) == [
        "Admit",
        "Attend",
        "Heartbeat",
        "Join",
        "Lease",
        "Leave",
        "PullGlobal",
        "PushPseudoGrad",
        "Retire",
        "Status",
    ]
    assert service.methods_by_name["PushPseudoGrad"].client_streaming
    assert service.methods_by_name["PullGlobal"].server_streaming
    assert "from transport import diloco_pb2" in Path(diloco_pb2_grpc.__file__).read_text()
