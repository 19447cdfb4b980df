"""The command line: ``jaxinfer generate`` / ``serve`` / ``quantize`` / ``train-draft-heads``."""
