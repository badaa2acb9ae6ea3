"""anec: the command line, recipes, checkpoint loading, the conversion pipeline and emitting."""
