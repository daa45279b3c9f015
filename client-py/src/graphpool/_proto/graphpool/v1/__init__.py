"""Generated protobuf/gRPC stubs (graphpool.v1). Regenerate with client-py/tools/gen_stubs.py."""
