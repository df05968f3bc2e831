"""Tests of dmlbook.advanced.context_parallel."""
