"""Host side: the weight store (fp32 masters, pinned compute-dtype shadows), gradient buffers, host memory, loading, the optimizer thread, gradient all-reduce across nodes."""
