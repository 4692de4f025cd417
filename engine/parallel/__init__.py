"""Tensor parallelism: process groups (NCCL on GPU, gloo on CPU), the worker processes the
LLM starts for itself, and the driver that fans one step out to every rank."""
