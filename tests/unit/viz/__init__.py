"""Tests of dmlbook.viz."""
