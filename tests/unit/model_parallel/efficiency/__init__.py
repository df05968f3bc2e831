"""Tests of dmlbook.model_parallel.efficiency."""
