"""Generated protobuf/gRPC stubs (root). Regenerate with client-py/tools/gen_stubs.py."""
