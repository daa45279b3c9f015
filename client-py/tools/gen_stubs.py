#!/usr/bin/env python3
"""Regenerate the checked-in gRPC/protobuf stubs of the graphpool package from ``proto/``.

Usage (from anywhere)::

    python client-py/tools/gen_stubs.py            # rewrite src/graphpool/_proto
    python client-py/tools/gen_stubs.py --out DIR  # write the stubs under DIR instead

The stubs must be generated with the grpcio-tools version pinned in ``GRPCIO_TOOLS_VERSION``
(see client-py/README.md, "Generated stubs", for why that version): its gencode imports under
protobuf 4.21+, 5.x and 6.x runtimes and any grpcio >= 1.49.

``protoc`` writes ``from graphpool.v1 import plan_pb2``, which would resolve against this
package (also called ``graphpool``); the imports are rewritten to be package-relative and the
module names recorded in the descriptors are made the real ones
(``graphpool._proto.graphpool.v1.*``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

#: grpcio-tools version the checked-in stubs are generated with.
GRPCIO_TOOLS_VERSION = "1.62.3"

HERE = Path(__file__).resolve().parent
CLIENT_ROOT = HERE.parent
REPO_ROOT = CLIENT_ROOT.parent
PROTO_ROOT = REPO_ROOT / "proto"
DEFAULT_OUT = CLIENT_ROOT / "src" / "graphpool" / "_proto"
PACKAGE = "graphpool._proto"
PROTO_FILES = ("graphpool/v1/graphpool.proto", "graphpool/v1/plan.proto")

_INIT_DOC = '"""Generated protobuf/gRPC stubs ({what}). Regenerate with client-py/tools/gen_stubs.py."""\n'


def _fix(text: str) -> str:
    """Makes one generated file importable as part of ``graphpool._proto``."""
    # `from graphpool.v1 import plan_pb2 as ...` -> `from . import plan_pb2 as ...`
    text = re.sub(r"^from graphpool\.v1 import ", "from . import ", text, flags=re.MULTILINE)
    # Module names the builder stamps on the message classes.
    text = text.replace("'graphpool.v1.", f"'{PACKAGE}.graphpool.v1.")
    # Type stubs refer to sibling modules by absolute name.
    text = re.sub(
        r"^import graphpool\.v1\.(\w+) as (\w+)$",
        r"from . import \1 as \2",
        text,
        flags=re.MULTILINE,
    )
    return text


def generate(out: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generates the stubs under ``out`` (created if missing) from the ``.proto`` files under
    ``proto_root``. Returns the files written."""
    try:
        from grpc_tools import protoc  # type: ignore[import-untyped]
    except ImportError:
        sys.exit(
            f"grpcio-tools is not installed: pip install grpcio-tools=={GRPCIO_TOOLS_VERSION}"
        )
    import grpc_tools

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(proto_root / f) for f in PROTO_FILES),
        ]
        rc = protoc.main(args)
        if rc != 0:
            sys.exit(f"protoc failed with exit code {rc}")
        gen = Path(tmp) / "graphpool" / "v1"
        dest = out / "graphpool" / "v1"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        written: list[Path] = []
        for src in sorted(gen.iterdir()):
            target = dest / src.name
            target.write_text(_fix(src.read_text()))
            written.append(target)
    for d, what in ((out, "root"), (out / "graphpool", "graphpool"), (dest, "graphpool.v1")):
        init = d / "__init__.py"
        init.write_text(_INIT_DOC.format(what=what))
        written.append(init)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--proto", type=Path, default=PROTO_ROOT, help="root of the .proto files")
    ns = parser.parse_args()
    try:
        import grpc_tools  # noqa: F401
        from importlib.metadata import version

        have = version("grpcio-tools")
        if have != GRPCIO_TOOLS_VERSION:
            print(
                f"warning: grpcio-tools {have} installed, stubs are pinned to "
                f"{GRPCIO_TOOLS_VERSION}; the output will differ from the checked-in stubs",
                file=sys.stderr,
            )
    except ImportError:
        pass
    for path in generate(ns.out, ns.proto):
        print(path)


if __name__ == "__main__":
    main()
