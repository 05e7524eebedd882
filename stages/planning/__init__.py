"""Decisions made before anything is launched, torch-free: the memory plan of a config on a device
(`memory_plan`) and the attention kernel rule (`attention`, whose rank-side helpers import torch inside
their functions). Planning (`stages.pipeline`, `sftflow show`) and the ranks apply the same rules, so the
plan says what the ranks will do. Never imports torch at module level (tests/test_architecture.py)."""
