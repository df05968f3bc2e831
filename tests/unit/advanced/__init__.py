"""Tests of dmlbook.advanced, one folder per strategy."""
