"""Recipes shipped with anec: one YAML file per supported model configuration."""
