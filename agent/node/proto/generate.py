"""Generate the Python gRPC code from agent/node/proto/*.proto (run by scripts/setup.sh).

    python -m agent.node.proto.generate            # (re)generate when the .proto changed
    python -m agent.node.proto.generate --check    # exit 1 if the generated code is missing or stale

The generated modules (dsec_agent_pb2.py, dsec_agent_pb2_grpc.py) are not
kept in the repository: they are produced by the set-up step from the .proto,
with the grpcio-tools of the venv, so they always match the installed
protobuf and grpcio runtimes. `STAMP` records the hash of the .proto they
were generated from; agent/node/proto/__init__.py refuses stale code.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
PROTOS = ("dsec_agent.proto",)
OUTPUTS = ("dsec_agent_pb2.py", "dsec_agent_pb2_grpc.py")
STAMP = os.path.join(HERE, ".generated")


def proto_hash() -> str:
    h = hashlib.sha256()
    for name in PROTOS:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:32]


def generated_hash() -> str | None:
    try:
        with open(STAMP) as f:
            return f.read().strip()
    except OSError:
        return None


def is_current() -> bool:
    return generated_hash() == proto_hash() and all(os.path.exists(os.path.join(HERE, o)) for o in OUTPUTS)


def generate(out_root: str) -> None:
    """Run protoc (grpcio-tools) with the repository root as include path,
    writing agent/node/proto/*_pb2*.py under out_root."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit("generate: grpcio-tools is not installed (scripts/setup.sh installs it)")
    import grpc_tools
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [os.path.join("agent", "node", "proto", p) for p in PROTOS]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"generate: protoc failed (exit {rc})")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        if is_current():
            return 0
        print("generate: the generated gRPC code is missing or stale: run scripts/setup.sh", file=sys.stderr)
        return 1
    if argv and argv != ["--force"]:
        print("usage: python -m agent.node.proto.generate [--check|--force]", file=sys.stderr)
        return 2
    if is_current() and argv != ["--force"]:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        for o in OUTPUTS:
            src = os.path.join(tmp, "agent", "node", "proto", o)
            dst = os.path.join(HERE, o)
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
    with open(STAMP + ".tmp", "w") as f:
        f.write(proto_hash() + "\n")
    os.replace(STAMP + ".tmp", STAMP)
    print("generate: agent/node/proto/dsec_agent_pb2*.py regenerated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
