"""Tests of dmlbook.netlab."""
