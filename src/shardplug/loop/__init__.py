"""The host-side loop: prefetch, signals, profiling, batch placement."""
