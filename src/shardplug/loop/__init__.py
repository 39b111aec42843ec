"""The host-side loop: dispatch and read-ahead, signals, profiling, batch placement."""
