"""Tests of dmlbook.advanced.tensor_parallel."""
