"""The conversion pipeline: steps, preflight, the manifest, the log and atomic publishing."""
