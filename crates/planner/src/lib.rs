//! Static-buffer planner for CUDA graph capture.
