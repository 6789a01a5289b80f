"""Tensor parallelism: ranks, the weight layout, worker processes and the step broadcast."""
