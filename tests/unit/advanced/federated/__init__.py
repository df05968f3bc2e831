"""Tests of dmlbook.advanced.federated."""
