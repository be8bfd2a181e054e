"""The foundation: errors, storage (local and S3, DCP readers and writers), the hardware's figures, torch's
private API behind one module, digests, signed directories, atomic publishing, stop signals, profiling.
Imports nothing else of plait."""
