"""Attention backends: the step metadata contract and the implementations."""
