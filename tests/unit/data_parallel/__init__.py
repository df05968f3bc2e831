"""Tests of dmlbook.data_parallel."""
