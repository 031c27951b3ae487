"""Shipped presets: hardware, models and jobs as YAML data."""
