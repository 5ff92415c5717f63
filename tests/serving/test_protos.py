"""The committed stubs in serving/pb are exactly what grpcio-tools makes of protos/."""

import filecmp
import os

from serving import protogen


def test_generated_code_matches_protos(tmp_path):
    names = protogen.generate(str(tmp_path))
    assert {"common_pb2.py", "router_pb2.py", "router_pb2_grpc.py", "cluster_pb2.py",
            "cluster_pb2_grpc.py"} <= set(names)
    committed = sorted(f for f in os.listdir(protogen.PB_DIR) if f.endswith(".py") and f != "__init__.py")
    assert committed == sorted(names), "stale or missing stubs: run python -m serving.protogen"
    for name in names:
        assert filecmp.cmp(tmp_path / name, os.path.join(protogen.PB_DIR, name), shallow=False), (
            f"{name} drifted from protos/: run python -m serving.protogen")


def test_protos_keep_next_id_comments():
    for name in protogen.PROTOS:
        with open(os.path.join(protogen.PROTO_DIR, "pddjax", "v1", name)) as f:
            text = f.read()
        assert "package pddjax.v1;" in text
    with open(os.path.join(protogen.PROTO_DIR, "pddjax", "v1", "router.proto")) as f:
        assert f.read().count("// Next ID:") >= 4
