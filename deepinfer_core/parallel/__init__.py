"""Parallelism on torch.distributed: expert-parallel dispatch (more to come: process groups, EPLB)."""
