"""kvforge.planner: the KV-cache resolver (no torch)."""
