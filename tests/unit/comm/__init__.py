"""Tests of dmlbook.comm."""
