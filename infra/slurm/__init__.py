"""Slurm through its commands: local test cluster, parsers, states, watcher, options, presets, preflight."""
