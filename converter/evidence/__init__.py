"""Evidence: the labels every figure carries, and re-running the gates on a published artifact."""
