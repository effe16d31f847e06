"""The device side: the model runner (batch preparation, forward, sampling), CUDA graphs, tensor-parallel ranks, compile caches."""
