//! Plans for CUDA graph buffers: the bridge between the API's `PlanInput`/`Plan` messages
//! and the `graphpool-planner` crate.
