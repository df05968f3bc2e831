"""Tests of dmlbook.advanced.composition."""
