"""``anec device-check``: an artifact's own gates run by Core ML on a Mac (macOS adapters in
`converter.coreml.runtime`), per compute-units setting, with timing and memory, in one
evidence file (`evidence`); `check` dispatches on the artifact's kind (`cached`, `window`,
`encoder`)."""
