"""Features of a run, each a callback on the engine's trainer: guards and the hang watchdog, the health check,
fault injection, the end-of-run report."""
