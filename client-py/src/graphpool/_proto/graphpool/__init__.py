"""Generated protobuf/gRPC stubs (graphpool). Regenerate with client-py/tools/gen_stubs.py."""
