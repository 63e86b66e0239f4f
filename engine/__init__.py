"""ringfleet's engine: one layer range of one model on one backend; rank 0 also serves HTTP."""

ENGINE_VERSION = "0.1.0"
