"""The model lifecycle after pre-training: fine-tuning (full and LoRA), the lineage registry, evaluation,
compression and serving several adapters of one base at once."""
