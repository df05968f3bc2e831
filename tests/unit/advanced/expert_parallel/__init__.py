"""Tests of dmlbook.advanced.expert_parallel."""
