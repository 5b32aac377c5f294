"""Generates the gRPC stubs in ffstate/_proto/ from proto/ffstate/v1/*.proto (``make proto``).

``--check`` regenerates into a temporary folder and exits 1 if the checked-in stubs differ.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "ffstate" / "_proto"


def generate() -> dict[str, str]:
    """File name -> contents of the generated stubs, imports made package-relative."""
    sources = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.glob("ffstate/v1/*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main(args + sources) != 0:
            raise SystemExit("protoc failed")
        out = {}
        for path in sorted(Path(tmp, "ffstate", "v1").iterdir()):
            text = path.read_text()
            # protoc writes "from ffstate.v1 import x_pb2"; the stubs live in ffstate._proto.
            text = re.sub(r"^from ffstate\.v1 import", "from ffstate._proto import", text, flags=re.M)
            out[path.name] = text
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the checked-in stubs, write nothing")
    args = parser.parse_args()
    files = generate()
    if args.check:
        stale = [n for n, t in files.items() if not (OUT_DIR / n).exists() or (OUT_DIR / n).read_text() != t]
        if stale:
            print(f"stale stubs (run `make proto`): {stale}", file=sys.stderr)
            return 1
        return 0
    for name, text in files.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {sorted(files)} to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
