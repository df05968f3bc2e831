"""Tests of dmlbook.advanced.elastic."""
