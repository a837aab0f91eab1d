"""The framework the roles stand on: host data, checks, what a run remembers, files, units."""
