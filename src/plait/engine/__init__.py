"""The trainer and what it is made of: the step, the loss, the optimizer, the callback protocol, checkpoints,
compile caches, metrics and trackers, validation, generation, the run directory and its lock. Imports core,
model, data, config and parallel; features attach to it as callbacks from above."""
