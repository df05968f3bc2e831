"""Tests of dmlbook.advanced.speedups."""
