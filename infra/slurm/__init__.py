"""Slurm through its commands: parsers, states, watcher, options, presets, preflight (the local test cluster is devtools.slurm_cluster)."""
