"""Tests of dmlbook.bench."""
