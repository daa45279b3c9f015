//! Allocator shim for `torch.cuda.CUDAPluggableAllocator`.
