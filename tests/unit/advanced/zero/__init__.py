"""Tests of dmlbook.advanced.zero."""
